// The fused forward's carried tails (task_list.cuh, gemm/carried_tail.cuh): the producer's loads
// of a tile that carries some of a tail's rows, and the consumers' stash and stores of them.
#pragma once

#include <cuda.h>

#include <cstdint>

#include "kernels/gemm/carried_tail.cuh"
#include "kernels/gemm/gemm_types.cuh"
#include "kernels/megakernel/forward_params.cuh"
#include "kernels/megakernel/task_list.cuh"
#include "kernels/ptx/barrier.cuh"
#include "kernels/ptx/tma.cuh"

namespace mok::megakernel {

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900

// The carried tails' stages (forward_params.cuh).
__device__ inline uint8_t* tail_stages(uint8_t* aligned_smem) { return aligned_smem + kTailOffset; }
using Tail = gemm::CarriedTail<kCarriedTailRows>;
static_assert(Tail::kAccumulators == kTailAccumulators, "the stash holds the tail");

// Producer: what a tile that carries a tail loads beside its own operands (Loop::load's
// `beside`): its kCarriedTailRows rows of the tail, into the stage's tail rows, on the same full
// barrier.
struct TailLoads {
  static constexpr uint32_t kBytes = kTailStageBytes;
  const CUtensorMap* map_tail;  // the routed kind's A in boxes of kCarriedTailRows rows
  uint8_t* tail_smem;           // tail_stages
  int tail_row;                 // the carrier's first row of the tail, in A

  __device__ TailLoads(const CUtensorMap* map, uint8_t* smem, const Task& task)
      : map_tail(map),
        tail_smem(smem),
        tail_row(task.tile.row_begin +
                 (task.tile.mblock + task.tail_offset()) * gemm::TileConfig::BLOCK_M +
                 task.tail_carrier * kCarriedTailRows) {}

  __device__ void issue(int stage, uint64_t* full, int k_block) const {
    ptx::tma_load_2d(tail_smem + stage * kTailStageBytes, map_tail, full,
                     k_block * gemm::TileConfig::BLOCK_K, tail_row);
  }
};

// Where this consumer thread's carried tail accumulators wait while the tile is stored: beside
// the tile's accumulators in the epilogue, ptxas spilled (those keep their registers throughout
// the consumer loop). Each thread's own floats, kConsumerThreads apart.
__device__ inline float* tail_stash(const uint8_t* tail_smem) {
  return reinterpret_cast<float*>(const_cast<uint8_t*>(tail_smem) +
                                  (kTailStashOffset - kTailOffset)) +
         (threadIdx.x - (kThreads - kConsumerThreads));
}

// A carried tail's stores, from its accumulators in `stash` (tail_stash).
// NOTE: not inlined: inlined, ptxas spilled ~60 bytes in the consumers (the tile's accumulators
// keep their registers throughout the consumer loop).
// `task`: the carrier; row_destination: its own rows'.
template <gemm::EpilogueKind kEpilogue, class RowDestination>
__device__ __noinline__ void store_tail(const gemm::GroupedGemmParams& gemm_params,
                                        const Task& task, int consumer_idx, const float* stash,
                                        const RowDestination& row_destination) {
  float tail[Tail::kAccumulators];
#pragma unroll
  for (int i = 0; i < Tail::kAccumulators; ++i) tail[i] = stash[i * kConsumerThreads];
  gemm::GroupedTile tile = task.tile;  // the tail block's
  tile.mblock += task.tail_offset();
  Tail::store<kEpilogue>(gemm_params, tile, task.tail_carrier * kCarriedTailRows, consumer_idx,
                         tail, row_destination.block(task.tail_offset()));
}

#endif  // __CUDA_ARCH__ >= 900

}  // namespace mok::megakernel
