"""Timing for the torch baselines: the median of CUDA-event times after warm-up (DESIGN.md §5)."""


def median_ms(fn, iterations, warmup=3, barrier=None, warmup_ms=0, decide=None):
    """Median milliseconds of `fn` over `iterations` timed calls; `barrier`, when given, runs
    before each call (e.g. a distributed barrier, so that ranks start together).

    Warm-up: `warmup` calls, then more, 4 at a time, until `warmup_ms` have passed: under the
    power cap the clock follows the power drawn over the last fraction of a second, so after a
    short warm-up the first timed calls run at the clock the idle GPU left. Where ranks must make
    the same calls, `decide(more)` turns this rank's "more" into the ranks' common answer."""
    import time

    import torch

    start = time.perf_counter()
    for _ in range(warmup):
        fn()
    while warmup_ms > 0:
        torch.cuda.synchronize()
        more = (time.perf_counter() - start) * 1e3 < warmup_ms
        if decide is not None:
            more = decide(more)
        if not more:
            break
        for _ in range(4):
            fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iterations):
        if barrier is not None:
            barrier()
        start = torch.cuda.Event(enable_timing=True)
        stop = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    times.sort()
    return times[len(times) // 2]
