"""Timing for the torch baselines: the median of CUDA-event times after warm-up (DESIGN.md §5)."""


def median_ms(fn, iterations, warmup=3, barrier=None, warmup_ms=0):
    """Median milliseconds of `fn` over `iterations` timed calls; `barrier`, when given, runs
    before each call (e.g. a distributed barrier, so that ranks start together). Warm-up: `warmup`
    calls, and more until `warmup_ms` have passed (under the power cap the clock follows the power
    of the last fraction of a second, so a short warm-up times a call at its predecessor's clock)."""
    import time

    import torch

    start = time.perf_counter()
    calls = 0
    while calls < warmup or (time.perf_counter() - start) * 1e3 < warmup_ms:
        fn()
        calls += 1
        if calls % 4 == 0:
            torch.cuda.synchronize()
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
