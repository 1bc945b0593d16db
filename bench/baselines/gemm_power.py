"""Clock, power and work per joule of one grouped GEMM case at the GPU's power cap: mok's kernel
beside torch._grouped_mm on the same shape and the dense 8192^3 bf16 GEMM, in the same run.

Each side runs for --seconds under load (bench_gemm's --warmup-ms for mok, the same warm-up loop
in-process for torch), then is timed (median of --iterations CUDA-event-timed launches), while
nvidia-smi samples the GPU every 20 ms. Every side computes on bench_gemm's uniform data; torch
also on normal data of the same scale (marked N). The samples of the last --window seconds of each
run (the clock has settled by then) give its mean SM clock, mean power (power.draw.instant) and
the share of samples with the software power cap active (samples under 300 W, the process
starting or exiting, are left out). From those:
  TFLOP per joule     = TFLOP/s / W: what the kernel gets out of the energy it may draw;
  share of the peak   = TFLOP/s / (SM clock x 4,096 bf16 FLOP per clock x SMs): how close the
                        kernel runs to the tensor cores' rate at the clock it gets.
Under a power cap the clock settles where the power drawn meets the cap, so a kernel's time is
its energy over the cap: the work per joule is what a faster kernel has to raise.

  python3 bench/baselines/gemm_power.py --bench build/bench_gemm --out gemm-power.json
"""
import argparse
import datetime
import json
import re
import subprocess
import threading
import time

import torch

from data import uniform  # bench/baselines/data.py: bench_gemm's distributions
from timing import median_ms  # bench/baselines/timing.py, beside this script

PRESETS = {  # one rank of EP2, balanced routing: (experts, rows per expert, n, k) of gate/up
    "deepseek-v3": (128, 512, 4096, 7168),
    "qwen3-30b-a3b": (64, 1024, 1536, 2048),
    "qwen3-235b-a22b": (64, 1024, 3072, 4096),
}
QUERY = "clocks.sm,power.draw.instant,clocks_event_reasons.sw_power_cap"
BF16_FLOP_PER_CLOCK_PER_SM = 4096


class Sampler:
    """nvidia-smi every 20 ms in the background; each line stamped on arrival."""

    def __init__(self, gpu):
        self.samples = []  # (monotonic seconds, MHz, W, power cap active)
        self.process = subprocess.Popen(
            ["nvidia-smi", "-i", str(gpu), f"--query-gpu={QUERY}", "--format=csv,noheader,nounits",
             "-lms", "20"], stdout=subprocess.PIPE, text=True)
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self):
        for line in self.process.stdout:
            fields = [f.strip() for f in line.split(",")]
            try:
                self.samples.append((time.monotonic(), float(fields[0]), float(fields[1]),
                                     fields[2] == "Active"))
            except (ValueError, IndexError):
                continue  # a field the driver does not report: skip the sample

    def window(self, end, seconds, min_power_w=300.0):
        """The samples of [end - seconds, end] drawn under load (the process start and exit
        around a run draw idle power, ~80-130 W on H200)."""
        chosen = [s for s in self.samples if end - seconds <= s[0] <= end and s[2] >= min_power_w]
        if not chosen:
            return None
        return {
            "samples": len(chosen),
            "sm_clock_mhz": sum(s[1] for s in chosen) / len(chosen),
            "power_w": sum(s[2] for s in chosen) / len(chosen),
            "power_cap_share": sum(1 for s in chosen if s[3]) / len(chosen),
        }

    def stop(self):
        self.process.terminate()
        self.process.wait()


def run_mok(bench, preset, engine, seconds, iterations):
    output = subprocess.run(
        [bench, "--only", f"{preset}/gemm-gateup", "--engine", engine, "--warmup-ms",
         str(int(seconds * 1000)), "--iterations", str(iterations), "--out", "/tmp/gemm-power-mok.json"],
        capture_output=True, text=True, check=True).stdout
    end = time.monotonic()
    match = re.search(r"([0-9.]+) ms\s+([0-9.]+) TFLOP/s", output)
    if not match:
        raise RuntimeError(f"no timing in bench_gemm's output: {output!r}")
    return float(match.group(1)), end


def run_torch(fn, seconds, iterations):
    ms = median_ms(fn, iterations, warmup_ms=seconds * 1000)
    return ms, time.monotonic()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bench", required=True, help="bench_gemm executable")
    parser.add_argument("--out", required=True, help="results JSON")
    parser.add_argument("--preset", default="deepseek-v3", choices=sorted(PRESETS))
    parser.add_argument("--engine", default="cooperative", help="mok engine (bench_gemm --engine)")
    parser.add_argument("--seconds", type=float, default=2.0, help="load before timing (default 2)")
    parser.add_argument("--window", type=float, default=1.0,
                        help="seconds of samples at the end of each run (default 1)")
    parser.add_argument("--iterations", type=int, default=100, help="timed launches (default 100)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of the three (default 2)")
    parser.add_argument("--gpu", type=int, default=0, help="nvidia-smi index of the GPU timed")
    parser.add_argument("--commit", default=None)
    args = parser.parse_args()

    experts, rows, n, k = PRESETS[args.preset]
    total = experts * rows
    flop = 2.0 * total * n * k
    offs = torch.arange(1, experts + 1, device="cuda", dtype=torch.int32) * rows
    # bench_gemm's own data: uniform in [-1, 1) (x) and [-0.05, 0.05) (w), as the baseline of
    # torch_grouped_mm.py draws it; torch also on normal values of the same scale (marked N): the
    # tensor cores' power, hence the clock under the cap, depends on the bits they multiply.
    x = uniform(total, k)
    w = uniform(experts, n, k, half_width=0.05)
    x_normal = torch.randn(total, k, device="cuda", dtype=torch.bfloat16)
    w_normal = torch.randn(experts, n, k, device="cuda", dtype=torch.bfloat16) * 0.05
    size = 8192
    a = uniform(size, size)
    b = uniform(size, size)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    sides = [
        (f"mok {args.engine}", flop,
         lambda: run_mok(args.bench, args.preset, args.engine, args.seconds, args.iterations)),
        ("torch._grouped_mm", flop,
         lambda: run_torch(lambda: torch._grouped_mm(x, w.transpose(-2, -1), offs=offs),
                           args.seconds, args.iterations)),
        ("torch._grouped_mm N", flop,
         lambda: run_torch(lambda: torch._grouped_mm(x_normal, w_normal.transpose(-2, -1), offs=offs),
                           args.seconds, args.iterations)),
        ("torch dense 8192^3", 2.0 * size**3,
         lambda: run_torch(lambda: a @ b, args.seconds, args.iterations)),
    ]
    sampler = Sampler(args.gpu)
    runs = []
    try:
        for round_idx in range(args.rounds):
            for name, side_flop, run in sides:
                ms, end = run()
                time.sleep(0.1)  # the sampler's last lines
                power = sampler.window(end, args.window)
                tflops = side_flop / ms / 1e9
                entry = {"round": round_idx, "side": name, "ms": ms, "tflops": tflops, **(power or {})}
                if power:
                    entry["tflop_per_joule"] = tflops / power["power_w"]
                    entry["share_of_peak_at_clock"] = tflops * 1e12 / (
                        power["sm_clock_mhz"] * 1e6 * BF16_FLOP_PER_CLOCK_PER_SM * sms)
                runs.append(entry)
                line = f"{name:20s} {ms:7.3f} ms {tflops:6.1f} TFLOP/s"
                if power:
                    line += (f"  {power['sm_clock_mhz']:5.0f} MHz {power['power_w']:5.0f} W"
                             f"  cap {100 * power['power_cap_share']:3.0f} %"
                             f"  {entry['tflop_per_joule']:.3f} TFLOP/J"
                             f"  {100 * entry['share_of_peak_at_clock']:4.1f} % of peak at clock")
                print(line, flush=True)
    finally:
        sampler.stop()
    result = {
        "schema": "mok-gemm-power/1",
        "commit": args.commit,
        "device": torch.cuda.get_device_name(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "preset": args.preset,
        "case": "gemm-gateup",
        "shape": {"experts": experts, "rows_per_expert": rows, "n": n, "k": k},
        "runs": runs,
    }
    json.dump(result, open(args.out, "w"), indent=2)


if __name__ == "__main__":
    main()
