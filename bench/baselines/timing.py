"""Timing for the torch baselines: the median of CUDA-event times after warm-up (DESIGN.md §5)."""
import time


def median_ms(fn, iterations, warmup=3, barrier=None, warmup_ms=0, decide=None, monitor=None,
              device="cuda"):
    """Median milliseconds of `fn` over `iterations` timed calls; `barrier`, when given, runs
    before each call (e.g. a distributed barrier, so that ranks start together).

    Warm-up: `warmup` calls, then more, 4 at a time, until `warmup_ms` have passed: under the
    power cap the clock follows the power drawn over the last fraction of a second, so after a
    short warm-up the first timed calls run at the clock the idle GPU left. Where ranks must make
    the same calls, `decide(more)` turns this rank's "more" into the ranks' common answer.
    `monitor` (gpu_monitor.GpuMonitor), when given, samples clock and power over the timed calls
    only. On `device="cpu"` the calls are timed by the host clock (smoke runs, no GPU)."""
    import torch

    on_gpu = device != "cpu"
    synchronize = torch.cuda.synchronize if on_gpu else (lambda: None)
    start = time.perf_counter()
    for _ in range(warmup):
        fn()
    while warmup_ms > 0:
        synchronize()
        more = (time.perf_counter() - start) * 1e3 < warmup_ms
        if decide is not None:
            more = decide(more)
        if not more:
            break
        for _ in range(4):
            fn()
    synchronize()
    if monitor is not None:
        monitor.start()
    times = []
    for _ in range(iterations):
        if barrier is not None:
            barrier()
        if on_gpu:
            start_event = torch.cuda.Event(enable_timing=True)
            stop_event = torch.cuda.Event(enable_timing=True)
            start_event.record()
            fn()
            stop_event.record()
            stop_event.synchronize()
            times.append(start_event.elapsed_time(stop_event))
        else:
            begin = time.perf_counter()
            fn()
            times.append((time.perf_counter() - begin) * 1e3)
    if monitor is not None:
        monitor.stop()
    times.sort()
    return times[len(times) // 2]
