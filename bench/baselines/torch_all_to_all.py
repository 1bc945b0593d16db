"""Baseline for bench_comm: torch.distributed.all_to_all_single (NCCL) moving the same bytes.

  torchrun --nproc-per-node=2 torch_all_to_all.py measure --splits splits.json --out torch.json
  python3 torch_all_to_all.py report --mok comm-a.json [comm-b.json ...] --torch torch.json \
      --json comm.json --png comm.png

`measure` reads the rows each rank sends to each peer (written by bench_comm --splits) and times
all_to_all_single for the dispatch direction (rank s sends rows_sent[s][d] rows to d) and the
combine direction (the transpose), each the median of the timed iterations, the maximum over
ranks. GB/s counts the rows that cross NVLink into the slower rank, as bench_comm does.
`report` fills the baseline fields of bench_comm's mok-bench/1 JSON and draws GB/s against SMs
(bench/report.py's chart).
"""
import argparse
import json
import os
import statistics
import sys


def measure(args):
    import torch
    import torch.distributed as dist

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == 2, f"expects 2 ranks, got {world}"
    torch.cuda.set_device(rank)
    with open(args.splits) as handle:
        splits = json.load(handle)
    row_elements = splits["row_bytes"] // 2
    rows_sent = splits["rows_sent"]  # [source][dest]
    results = {}
    for phase in ("dispatch", "combine"):
        # combine sends each expert output row back to its token's owner: the transpose.
        sent = [rows_sent[rank][d] if phase == "dispatch" else rows_sent[d][rank] for d in range(world)]
        received = [rows_sent[s][rank] if phase == "dispatch" else rows_sent[rank][s] for s in range(world)]
        send = torch.randn(sum(sent) * row_elements, device="cuda").to(torch.bfloat16)
        recv = torch.empty(sum(received) * row_elements, device="cuda", dtype=torch.bfloat16)
        in_splits = [n * row_elements for n in sent]
        out_splits = [n * row_elements for n in received]
        times = []
        for iteration in range(args.warmup + args.iters):
            dist.barrier()
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dist.all_to_all_single(recv, send, out_splits, in_splits)
            end.record()
            torch.cuda.synchronize()
            if iteration >= args.warmup:
                times.append(start.elapsed_time(end))
        ms = torch.tensor([statistics.median(times)], device="cuda", dtype=torch.float64)
        remote = [received[1 - rank] * splits["row_bytes"]]
        gbps = torch.tensor([remote[0] / (ms.item() * 1e6)], device="cuda", dtype=torch.float64)
        dist.all_reduce(ms, op=dist.ReduceOp.MAX)
        dist.all_reduce(gbps, op=dist.ReduceOp.MIN)
        results[phase] = {"ms": ms.item(), "gbps": gbps.item()}
    if rank == 0:
        results["torch"] = torch.__version__
        results["nccl"] = ".".join(str(v) for v in torch.cuda.nccl.version())
        with open(args.out, "w") as handle:
            json.dump(results, handle, indent=2)
        for phase in ("dispatch", "combine"):
            print(f"torch all_to_all_single {phase}: {results[phase]['ms']:.3f} ms, "
                  f"{results[phase]['gbps']:.1f} GB/s")
    dist.destroy_process_group()


def report(args):
    bench = None
    for path in args.mok:  # one bench_comm JSON per copy method, merged
        with open(path) as handle:
            part = json.load(handle)
        if bench is None:
            bench = part
        else:
            bench["cases"].extend(part["cases"])
    with open(args.torch) as handle:
        torch_results = json.load(handle)
    label = (f"torch.distributed.all_to_all_single (NCCL {torch_results['nccl']}, "
             f"torch {torch_results['torch']})")
    for case in bench["cases"]:
        baseline = torch_results[case["phase"]]
        case["baseline"] = label
        case["baseline_ms"] = round(baseline["ms"], 4)
        case["speedup"] = round(baseline["ms"] / case["mok_ms"], 3)
    bench["benchmark"] = "comm"
    with open(args.json, "w") as handle:
        json.dump(bench, handle, indent=2)
    if args.png:  # the chart bench/report.py draws for this benchmark
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        import report

        report.chart("comm", bench, args.png)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("measure")
    run.add_argument("--splits", required=True)
    run.add_argument("--out", required=True)
    run.add_argument("--iters", type=int, default=20)
    run.add_argument("--warmup", type=int, default=3)
    rep = sub.add_parser("report")
    rep.add_argument("--mok", required=True, nargs="+")
    rep.add_argument("--torch", required=True)
    rep.add_argument("--json", required=True)
    rep.add_argument("--png", help="the chart (bench/report.py's, GB/s against SMs)")
    args = parser.parse_args()
    measure(args) if args.command == "measure" else report(args)


if __name__ == "__main__":
    sys.exit(main())
