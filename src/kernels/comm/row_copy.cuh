// Moving token rows (2·H contiguous bytes each) between GPUs: the one data-movement primitive of
// dispatch (pull from the owner's window) and combine (push into the owner's slots).
//
// `row_at(row)` returns the source and destination of a row, or a null source for a row to skip;
// rows are dealt to the grid's warps round-robin. One warp per row, each lane holding
// kVectorUnroll 16-byte loads in flight before it stores them; 1024 threads per CTA keep 128 KiB
// in flight per SM, which is what an NVLink pull needs to cover its latency (docs/perf-notes/
// comm.md; a copy-engine variant with 1-D bulk copies measured slower and went to git history).
#pragma once

#include <cstdint>

#include "kernels/comm/flags.cuh"

namespace mok::comm {

inline constexpr int kVectorMaxThreads = 1024;  // the vector kernels are built for up to this
inline constexpr int kVectorUnroll = 8;

struct RowCopy {
  const char* source;  // nullptr: skip this row
  char* destination;
};

#if defined(__CUDACC__)

// How a row's source is read:
//   kCoherent  plain loads
//   kReadOnly  the sources are local and no thread writes them during the kernel, so they may take
//              the non-coherent path (ld.global.nc), which keeps more loads in flight
//   kBypassL1  loads cached in L2 only (ld.global.cg): sources written during the kernel, e.g. by a
//              peer and published through a flag
enum class RowLoad : int { kCoherent, kReadOnly, kBypassL1 };

// One warp copies one row (row_bytes, a multiple of 16), lane `lane` of it, each lane holding
// kUnroll 16-byte loads in flight (more for CTAs with fewer threads than the copy kernels').
template <RowLoad kLoad, int kUnroll = kVectorUnroll>
__device__ inline void copy_row_warp(const char* from, char* to, int64_t row_bytes, int lane) {
  const int4* source = reinterpret_cast<const int4*>(from);  // (row_bytes / 16)
  int4* destination = reinterpret_cast<int4*>(to);
  const int64_t num_vectors = row_bytes / 16;
  for (int64_t base = lane; base < num_vectors; base += 32 * kUnroll) {
    int4 values[kUnroll];
#pragma unroll
    for (int unroll = 0; unroll < kUnroll; ++unroll) {
      const int64_t index = base + unroll * 32;
      if (index < num_vectors) {
        if constexpr (kLoad == RowLoad::kReadOnly) {
          values[unroll] = __ldg(source + index);
        } else if constexpr (kLoad == RowLoad::kBypassL1) {
          values[unroll] = __ldcg(source + index);
        } else {
          values[unroll] = source[index];
        }
      }
    }
#pragma unroll
    for (int unroll = 0; unroll < kUnroll; ++unroll) {
      const int64_t index = base + unroll * 32;
      if (index < num_vectors) destination[index] = values[unroll];
    }
  }
}

// Rows [0, num_rows) dealt to the grid's warps in turn: per_row(row, lane) by each warp's lanes.
template <class PerRow>
__device__ inline void for_each_row_warp(int64_t num_rows, const PerRow& per_row) {
  const int lane = threadIdx.x % 32;
  const int64_t warps_per_cta = blockDim.x / 32;
  for (int64_t row = blockIdx.x * warps_per_cta + threadIdx.x / 32; row < num_rows;
       row += gridDim.x * warps_per_cta) {
    per_row(row, lane);
  }
}

// Every row, dealt to the grid's warps in turn.
template <bool kSourceReadOnly, class RowAt>
__device__ inline void copy_rows_vector(int64_t num_rows, int64_t row_bytes, const RowAt& row_at) {
  for_each_row_warp(num_rows, [&](int64_t row, int lane) {
    const RowCopy copy = row_at(row);
    if (copy.source == nullptr) return;
    copy_row_warp<kSourceReadOnly ? RowLoad::kReadOnly : RowLoad::kCoherent>(
        copy.source, copy.destination, row_bytes, lane);
  });
}

#endif  // __CUDACC__

}  // namespace mok::comm
