"""Timing for the torch baselines: the median of CUDA-event times after warm-up (DESIGN.md §5)."""


def median_ms(fn, iterations, warmup=3, barrier=None):
    """Median milliseconds of `fn` over `iterations` timed calls; `barrier`, when given, runs
    before each call (e.g. a distributed barrier, so that ranks start together)."""
    import torch

    for _ in range(warmup):
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
