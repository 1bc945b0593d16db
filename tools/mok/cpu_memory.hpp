// What `mok run --backend cpu` holds in memory, counted from the buffers it allocates, so that a
// run that cannot fit is refused before it starts instead of being killed half way.
#pragma once

#include <cstdint>
#include <string>

#include "mok/precision.hpp"
#include "mok/shape.hpp"

namespace mok::cli {

// Bytes, by what holds them. The run's peak is resident + the largest of the phases, which run
// one after another and free their buffers in between.
struct CpuMemory {
  double weights = 0;  // the problem: bf16 weights of every expert, x, dy, routing
  double outputs = 0;  // y, dx, d_topk_w and the fp32 weight gradients of every rank
  double run = 0;      // the forward's or the backward's per-row buffers, whichever is larger
  double ep1_run = 0;  // --check, EP > 1: an EP=1 run's outputs and buffers, compared bitwise
  double oracle = 0;   // --check: the fp64 oracle's gradients, outputs and per-row buffers (and
                       // in an FP8 mode the quantized yardstick's, beside the oracle's results)

  double peak() const;
  std::string describe() const;  // "weights 1.1 GiB, gradients and outputs 2.3 GiB, ..."
};

CpuMemory cpu_memory(const LayerShape& shape, int64_t tokens_per_rank, int64_t ep, bool check,
                     int num_threads, Precision precision);

// "7.9 GiB", or "12 MiB" below one GiB (rounded up).
std::string format_bytes(double bytes);

// This process's peak resident memory so far (VmHWM), or 0 when it cannot be read.
double peak_resident_bytes();

// Bytes this process may still take: MemAvailable, or less where a cgroup limit says so; 0 when
// neither can be read.
double available_memory_bytes();

}  // namespace mok::cli
