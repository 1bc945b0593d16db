"""The random data the torch baselines compute on: the distributions mok's benchmarks use.

bench_gemm fills its operands with uniform values (activations in [-1, 1), weights in
[-0.05, 0.05)), and bench_layer with uniform values of a given standard deviation. The baselines
draw theirs the same way: under the GPU's power cap the clock, hence the time, depends on the bits
the tensor cores multiply, and torch._grouped_mm measured 1-2 % faster on uniform values than on
normal ones of the same scale (perf-notes/gemm.md v20).
"""
import math

import torch


def uniform(*shape, half_width=1.0):
    """bf16 values uniform in [-half_width, half_width), on the GPU."""
    values = torch.empty(*shape, device="cuda", dtype=torch.float32).uniform_(-half_width, half_width)
    return values.to(torch.bfloat16)


def uniform_std(*shape, std):
    """bf16 values uniform with standard deviation `std` (half width std * sqrt(3))."""
    return uniform(*shape, half_width=std * math.sqrt(3.0))
