// The fused forward's carried tails (task_list.cuh, gemm/carried_tail.cuh): the producer's loads
// of a tile that carries some of a tail's rows, and the consumers' stash and stores of them.
#pragma once

#include <cuda.h>

#include <cstdint>

#include "kernels/gemm/carried_tail.cuh"
#include "kernels/gemm/gemm_types.cuh"
#include "kernels/gemm/tile_loader.cuh"
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

// Producer, all 32 lanes: the loads of a tile that carries a tail (Loop::load's, and its
// kCarriedTailRows rows of the tail beside them, on the same full barrier).
__device__ inline void load_with_tail(const CUtensorMap* map_a, const CUtensorMap* map_b,
                                      const CUtensorMap* map_tail, const Loop::Storage& smem,
                                      uint8_t* tail_smem, const gemm::GroupedGemmParams& params,
                                      const Task& task, Loop::State& state) {
  using Loader = gemm::TileLoader<gemm::GemmKind::kForward, gemm::TileConfig>;
  const gemm::GroupedTile& tile = task.tile;
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int num_blocks = gemm::ceil_div(params.k, gemm::TileConfig::BLOCK_K);
  const int tail_row = tile.row_begin +
                       (tile.m_block + task.tail_offset()) * gemm::TileConfig::BLOCK_M +
                       task.tail_carrier * kCarriedTailRows;
  for (int k_block = 0; k_block < num_blocks; ++k_block) {
    ptx::mbarrier_wait(&smem.empty[state.index], state.phase ^ 1u);
    if (lane == 0) {
      uint64_t* full = &smem.full[state.index];
      ptx::mbarrier_arrive_expect_tx(full, gemm::TileConfig::kStageBytes + kTailStageBytes);
      Loader::issue_loads(map_a, map_b, smem, state.index, full, tile, k_block);
      ptx::tma_load_2d(tail_smem + state.index * kTailStageBytes, map_tail, full,
                       k_block * gemm::TileConfig::BLOCK_K, tail_row);
    }
    __syncwarp();
    state.advance();
  }
}

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
  tile.m_block += task.tail_offset();
  Tail::store<kEpilogue>(gemm_params, tile, task.tail_carrier * kCarriedTailRows, consumer_idx,
                         tail, row_destination.block(task.tail_offset()));
}

#endif  // __CUDA_ARCH__ >= 900

}  // namespace mok::megakernel
