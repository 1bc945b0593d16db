// Moving token rows (2·H contiguous bytes each) between GPUs: the one data-movement primitive of
// dispatch (pull from the owner's window) and combine (push into the owner's slots).
//
// Two ways, same contract: `row_at(row)` returns the source and destination of a row, or a null
// source for a row to skip; rows are dealt to CTAs round-robin (row = cta + i * num_ctas).
//   kVector: one warp per row, each lane holding kVectorUnroll 16-byte loads in flight before it
//            stores them; 1024 threads per CTA keep 128 KiB in flight per SM, which is what an
//            NVLink pull needs to cover its latency (measured: docs/perf-notes/comm.md).
//   kBulk:   one thread per CTA drives a ring of shared-memory stages with 1-D bulk copies
//            (cp.async.bulk, the copy engine of TMA without a tensor map): global -> shared
//            completes on an mbarrier, shared -> global is a bulk group. A CTA keeps
//            (stages - 1) rows in flight with one thread. Measured slower than kVector on H200
//            (the copy engine's pulls from a peer do not overlap enough), kept for comparison.
#pragma once

#include <cstdint>

#include "kernels/comm/flags.cuh"
#if defined(__CUDACC__)
#include "kernels/ptx/barrier.cuh"
#include "kernels/ptx/memory.cuh"
#include "kernels/ptx/tma.cuh"  // the bulk copies and async-group waits of the bulk path
#endif

namespace mok::comm {

enum class CopyMethod : int { kVector = 0, kBulk = 1 };

inline constexpr int kVectorMaxThreads = 1024;  // the vector kernels are built for up to this
inline constexpr int kVectorUnroll = 8;
inline constexpr int kBulkThreads = 32;
inline constexpr int kBulkMaxStages = 14;
inline constexpr int kBulkStageBudgetBytes = 200 * 1024;

struct RowCopy {
  const char* source;  // nullptr: skip this row
  char* destination;
};

MOK_COMM_HOST_DEVICE int bulk_stage_count(int64_t row_bytes) {
  const int64_t fit = kBulkStageBudgetBytes / row_bytes;
  return static_cast<int>(fit < kBulkMaxStages ? fit : kBulkMaxStages);
}

// Dynamic shared memory of the bulk path: the stages, then one mbarrier per stage.
MOK_COMM_HOST_DEVICE int64_t bulk_shared_bytes(int64_t row_bytes) {
  const int stages = bulk_stage_count(row_bytes);
  return stages * row_bytes + stages * 8;
}

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

// Every row, dealt to the grid's warps in turn.
template <bool kSourceReadOnly, class RowAt>
__device__ inline void copy_rows_vector(int64_t num_rows, int64_t row_bytes, const RowAt& row_at) {
  const int lane = threadIdx.x % 32;
  const int64_t warps_per_cta = blockDim.x / 32;
  for (int64_t row = blockIdx.x * warps_per_cta + threadIdx.x / 32; row < num_rows;
       row += gridDim.x * warps_per_cta) {
    const RowCopy copy = row_at(row);
    if (copy.source == nullptr) continue;
    copy_row_warp<kSourceReadOnly ? RowLoad::kReadOnly : RowLoad::kCoherent>(
        copy.source, copy.destination, row_bytes, lane);
  }
}

__device__ __forceinline__ void bulk_load_row(void* stage, const void* source, uint32_t bytes,
                                              uint64_t* barrier) {
  ptx::mbarrier_arrive_expect_tx(barrier, bytes);
  ptx::bulk_load(stage, source, bytes, barrier);
}

__device__ __forceinline__ void bulk_store_row(void* destination, const void* stage,
                                               uint32_t bytes) {
  ptx::bulk_store(destination, stage, bytes);
  ptx::bulk_commit_group();
}

// Thread 0 of the CTA copies its rows; the others only pass through. On return from thread 0,
// every store has completed and is ordered for a following generic-proxy release.
template <class RowAt>
__device__ inline void copy_rows_bulk(int64_t num_rows, int64_t row_bytes, char* shared_stages,
                                      const RowAt& row_at) {
  if (threadIdx.x != 0) return;
  const int num_stages = bulk_stage_count(row_bytes);
  uint64_t* barriers = reinterpret_cast<uint64_t*>(shared_stages + num_stages * row_bytes);
  char* destinations[kBulkMaxStages];  // where the row in each stage goes
  for (int stage = 0; stage < num_stages; ++stage) ptx::mbarrier_init(&barriers[stage], 1);
  // NOTE: the copy engine (async proxy) must see the initialised barriers and the data the
  // previous kernels wrote through the generic proxy.
  ptx::fence_barrier_init();
  ptx::fence_proxy_async_shared();
  ptx::fence_proxy_async_global();

  const uint32_t bytes = static_cast<uint32_t>(row_bytes);
  int64_t cursor = blockIdx.x;
  uint32_t issued = 0, drained = 0;
  auto issue_next = [&]() {
    while (cursor < num_rows) {
      const RowCopy copy = row_at(cursor);
      cursor += gridDim.x;
      if (copy.source == nullptr) continue;
      const int stage = static_cast<int>(issued % num_stages);
      destinations[stage] = copy.destination;
      bulk_load_row(shared_stages + stage * row_bytes, copy.source, bytes, &barriers[stage]);
      ++issued;
      return;
    }
  };
  for (int stage = 0; stage + 1 < num_stages; ++stage) issue_next();
  while (drained < issued) {
    const int stage = static_cast<int>(drained % num_stages);
    ptx::mbarrier_wait(&barriers[stage], (drained / num_stages) & 1u);
    bulk_store_row(destinations[stage], shared_stages + stage * row_bytes, bytes);
    // The store of the previous row has left its stage: that stage takes the next load.
    ptx::bulk_wait_group_read<1>();
    ++drained;
    issue_next();
  }
  ptx::bulk_wait_group<0>();
  ptx::fence_proxy_async_global();
}

#endif  // __CUDACC__

}  // namespace mok::comm
