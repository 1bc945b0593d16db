"""The random data the torch baselines compute on: the distributions mok's benchmarks use.

bench_gemm fills its operands with uniform values (activations in [-1, 1), weights in
[-0.05, 0.05)), and bench_layer with uniform values of a given standard deviation. The baselines
draw theirs the same way: under the GPU's power cap the clock, hence the time, depends on the bits
the tensor cores multiply, and torch._grouped_mm measured 1-2 % faster on uniform values than on
normal ones of the same scale (perf-notes/gemm.md v20).
"""
import math

import torch


def uniform(*shape, half_width=1.0, device="cuda", generator=None):
    """bf16 values uniform in [-half_width, half_width) (drawn in fp32, rounded once), on
    `device`; with `generator`, the same values on any device of the same kind."""
    values = torch.empty(*shape, device=device, dtype=torch.float32)
    values.uniform_(-half_width, half_width, generator=generator)
    return values.to(torch.bfloat16)


def uniform_std(*shape, std, device="cuda", generator=None):
    """bf16 values uniform with standard deviation `std` (half width std * sqrt(3))."""
    return uniform(*shape, half_width=std * math.sqrt(3.0), device=device, generator=generator)


def seeded_generator(seed, device):
    """A generator on `device` (a torch.device or its name) started at `seed`."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator
