// The combine's reduce, folded into the shared expert's down tiles (the last tasks of the list):
// the consumers hold S, the tile's (128, 256) fp32 slice of the shared expert's output, and
// compute for each of its tokens and columns
//   y = bf16(sum_j w[t, j] * slot[t, j]  (fp32, in j order, -1 slots skipped)  + S)
// with the operations of comm::combine_reduce, so the bits are the same; S never goes to memory
// and no reduce runs after the kernel. The slots are complete once every rank's combine flag is
// up (wait_for_combine).
//
// The accumulator fragment does not match the slots' rows, so S goes through shared memory: the
// stage ring, which the producer leaves alone until the tile's epilogue is done (it waits on
// RingHold before loading the task after a shared down tile). Each consumer warpgroup stages its
// slice row-major, each row's 8-column vectors swizzled by the row (vector v of row r at
// v ^ r % 8 within its group of 8), then walks it as the reduce walks y: a row's 8-column vector
// per thread, its k slot vectors loaded at once (16 bytes each), then summed in order.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/comm/flags.cuh"
#include "kernels/comm/workspace_layout.cuh"
#include "kernels/gemm/gemm_types.cuh"
#include "kernels/megakernel/forward_params.cuh"
#include "kernels/megakernel/sync.cuh"
#include "kernels/megakernel/task_list.cuh"
#include "kernels/ptx/barrier.cuh"
#include "mok/detail/numerics.hpp"

namespace mok::megakernel {

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900

inline constexpr int kCombineVector = 8;     // bf16 per 16-byte slot load
inline constexpr int kCombineSlotBatch = 8;  // slot loads of one item in flight
inline constexpr int kCombineItems = 2;      // items (row vectors) of a thread in flight

static_assert(Loop::Storage::Config::BLOCK_M * Loop::Storage::Config::BLOCK_N * 4 <=
                  RingLayout::kStagingOffset,
              "the fp32 tile fits in the stage ring");

// All consumer threads: true once every rank has pushed its rows into this rank's slots (false
// after a recorded error or a timeout; then no y is written and the host reports the failure).
__device__ inline bool wait_for_combine(const FusedForwardParams& params) {
  __shared__ int combined;
  if (threadIdx.x == 128) {
    const comm::WorkspaceView& view = params.view;
    const uint32_t epoch = view.state()->epoch;
    bool ok = true;
    for (int source = 0; source < view.layout.num_ranks && ok; ++source) {
      ok = comm::wait_flag(view, comm::FlagKind::kCombine, source, epoch, comm::Phase::kReduce);
    }
    combined = ok ? 1 : 0;
  }
  consumer_barrier();
  return combined != 0;
}

// The 128 threads of one consumer warpgroup: named barriers 2 and 3 (1 is consumer_barrier).
// NOTE: immediate ids; a barrier id in a register makes ptxas reserve all 16.
__device__ __forceinline__ void warpgroup_barrier(int consumer_idx) {
  if (consumer_idx == 0) {
    asm volatile("bar.sync 2, 128;" ::: "memory");
  } else {
    asm volatile("bar.sync 3, 128;" ::: "memory");
  }
}

// Where fp32 element (row, column) of a staged slice with kColumns columns lies.
template <int kColumns>
__device__ __forceinline__ int staged_index(int row, int column) {
  const int block = column / 8;
  return row * kColumns + 8 * ((block & ~7) | ((block ^ row) & 7)) + column % 8;
}

// The 128 threads of consumer warpgroup consumer_idx, after the mainloop of a shared down tile
// (every stage consumed): its slice's rows of y. kColumns: 256, or 128 in a half tile (rows 0-63,
// columns 128 c .. 128 c + 127 of consumer c, in the first 64 accumulators).
template <int kColumns, int kNumAccumulators>
__device__ inline void combine_slice(const FusedForwardParams& params, const Task& task,
                                     int consumer_idx, float* ring,
                                     const float (&accum)[kNumAccumulators]) {
  using Config = gemm::TileConfig;
  constexpr bool kHalfTile = kColumns < Config::BLOCK_N;
  constexpr int kVectors = kColumns / kCombineVector;  // per row
  const comm::WorkspaceView& view = params.view;
  const comm::WorkspaceLayout& layout = view.layout;
  const int thread = static_cast<int>(threadIdx.x % 128);
  const int warp = thread / 32, lane = thread % 32;
  float* slice = ring + consumer_idx * 64 * kColumns;  // (64, kColumns) fp32, swizzled
#pragma unroll
  for (int block = 0; block < kColumns / 8; ++block) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = warp * 16 + lane / 4 + 8 * half;
      const int index = 4 * block + 2 * half;
      *reinterpret_cast<float2*>(slice + staged_index<kColumns>(row, 8 * block + 2 * (lane % 4))) =
          make_float2(accum[index], accum[index + 1]);
    }
  }
  warpgroup_barrier(consumer_idx);

  const int first_token = task.tile.m_block * Config::BLOCK_M + (kHalfTile ? 0 : 64 * consumer_idx);
  const int first_column =
      task.tile.n_block * Config::BLOCK_N + (kHalfTile ? kColumns * consumer_idx : 0);
  const int64_t hidden = layout.hidden, top_k = layout.top_k, row_bytes = layout.row_bytes();
  const int32_t* ids = view.topk(view.rank, view.rank);  // (T, k), this rank's own
  // NOTE: the fused workspace has no expert_y: every routed row, this rank's own too, is in a slot.
  const char* slots = view.slot_row(view.rank, 0, 0);
#pragma unroll 1
  for (int first_item = thread; first_item < 64 * kVectors; first_item += 128 * kCombineItems) {
    float sum[kCombineItems][kCombineVector];
    bool valid[kCombineItems];
    int64_t token[kCombineItems], column[kCombineItems];
#pragma unroll
    for (int item = 0; item < kCombineItems; ++item) {
      const int index = first_item + 128 * item;
      token[item] = first_token + index / kVectors;
      column[item] = first_column + kCombineVector * (index % kVectors);
      valid[item] = index < 64 * kVectors && token[item] < params.num_tokens && column[item] < hidden;
#pragma unroll
      for (int lane_idx = 0; lane_idx < kCombineVector; ++lane_idx) sum[item][lane_idx] = 0.0f;
    }
    for (int64_t batch = 0; batch < top_k; batch += kCombineSlotBatch) {
      int4 packed[kCombineItems][kCombineSlotBatch];
      float weight[kCombineItems][kCombineSlotBatch];
      uint32_t used[kCombineItems];  // bit i: slot batch + i of the item holds an expert
#pragma unroll
      for (int item = 0; item < kCombineItems; ++item) {
        used[item] = 0;
#pragma unroll
        for (int index = 0; index < kCombineSlotBatch; ++index) {
          const int64_t slot = batch + index;
          const int32_t expert =
              valid[item] && slot < top_k ? ids[token[item] * top_k + slot] : -1;
          weight[item][index] = 0.0f;
          packed[item][index] = make_int4(0, 0, 0, 0);
          if (expert < 0) continue;  // an unused slot (or past k): skipped in the sum below
          used[item] |= 1u << index;
          weight[item][index] = params.topk_w[token[item] * top_k + slot];
          packed[item][index] = *reinterpret_cast<const int4*>(
              slots + (token[item] * top_k + slot) * row_bytes + column[item] * 2);
        }
      }
#pragma unroll
      for (int item = 0; item < kCombineItems; ++item) {
#pragma unroll
        for (int index = 0; index < kCombineSlotBatch; ++index) {
          if ((used[item] >> index & 1u) == 0) continue;
          const __nv_bfloat16* values =
              reinterpret_cast<const __nv_bfloat16*>(&packed[item][index]);
#pragma unroll
          for (int lane_idx = 0; lane_idx < kCombineVector; ++lane_idx) {
            sum[item][lane_idx] =
                numerics::add_rn(sum[item][lane_idx],
                                 numerics::mul_rn(weight[item][index], __bfloat162float(values[lane_idx])));
          }
        }
      }
    }
#pragma unroll
    for (int item = 0; item < kCombineItems; ++item) {
      if (!valid[item]) continue;
      const int index = first_item + 128 * item;
      const int row = index / kVectors;
      const float* shared = slice + staged_index<kColumns>(row, kCombineVector * (index % kVectors));
      int4 packed_out;
      __nv_bfloat16* out = reinterpret_cast<__nv_bfloat16*>(&packed_out);
#pragma unroll
      for (int lane_idx = 0; lane_idx < kCombineVector; ++lane_idx) {
        out[lane_idx] = __float2bfloat16_rn(numerics::add_rn(sum[item][lane_idx], shared[lane_idx]));
      }
      *reinterpret_cast<int4*>(params.y + token[item] * hidden + column[item]) = packed_out;
    }
  }
}

// The whole consumer side (256 threads), after a shared down tile's mainloop: y for its tokens
// (when `combined`), then the ring goes back to the producer (ring_free).
template <int kNumAccumulators>
__device__ inline void combine_into_y(const FusedForwardParams& params, const Task& task,
                                      int consumer_idx, bool combined, uint8_t* ring,
                                      uint64_t* ring_free, const float (&accum)[kNumAccumulators]) {
  if (combined) {
    float* ring_floats = reinterpret_cast<float*>(ring);
    if (gemm::is_half_tile<gemm::GemmKind::kForward>(task.tile)) {
      combine_slice<gemm::TileConfig::BLOCK_N / 2>(params, task, consumer_idx, ring_floats, accum);
    } else {
      combine_slice<gemm::TileConfig::BLOCK_N>(params, task, consumer_idx, ring_floats, accum);
    }
  }
  // NOTE: the producer's next TMA loads (async proxy) overwrite what these threads wrote and read.
  ptx::fence_proxy_async_shared();
  consumer_barrier();
  if (threadIdx.x == 128) ptx::mbarrier_arrive(ring_free);
}

#endif  // __CUDA_ARCH__ >= 900

}  // namespace mok::megakernel
