// The ping-pong persistent grouped GEMM: one CTA per SM, one producer warpgroup and two consumer
// warpgroups that take the CTA's (BLOCK_M, BLOCK_N) tiles in turn. Consumer c runs the mainloop
// of tiles c, c + 2, ... of the CTA's sequence; it starts a mainloop only when the other consumer
// has waited on every stage of the previous tile, so the two mainloops alternate on the tensor
// cores and each epilogue (SwiGLU, the stores, the wgrad accumulator reload) runs beside the
// other's MMAs:
//
//   consumer 0:  mma t0 | store t0      | mma t2 | store t2      | ...
//   consumer 1:  wait   | mma t1        | store t1 | mma t3      | ...
//
// Same sums, same order per element as the cooperative kernel (grouped_gemm_kernel.cuh).
#pragma once

#include <cuda.h>

#include "kernels/gemm/gemm_types.cuh"
#include "kernels/gemm/grouped_gemm_kernel.cuh"
#include "kernels/gemm/pingpong_epilogue.cuh"
#include "kernels/gemm/pingpong_mainloop.cuh"
#include "kernels/gemm/pingpong_types.cuh"
#include "kernels/gemm/tile_scheduler.cuh"
#include "kernels/ptx/barrier.cuh"
#include "kernels/ptx/named_barrier.cuh"
#include "kernels/ptx/tma.cuh"

namespace mok::gemm {

template <GemmKind kKind, EpilogueKind kEpilogue, int kBlockM>
__global__ void __launch_bounds__(PingpongConfig<kBlockM>::kNumThreads, 1)
    pingpong_gemm_kernel(const __grid_constant__ CUtensorMap map_a,
                         const __grid_constant__ CUtensorMap map_b,
                         const __grid_constant__ CUtensorMap /*map_c: warp stores here*/,
                         const GroupedGemmParams params) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using Layout = PingpongSharedLayout<kEpilogue, kBlockM>;
  using Loop = PingpongMainloop<kKind, Layout>;
  using Store = PingpongEpilogue<kKind, kEpilogue, kBlockM>;
  extern __shared__ __align__(1024) uint8_t dynamic_smem[];
  // NOTE: the 128-byte swizzle pattern repeats every 1024 B; the descriptors assume stage
  // buffers start on that boundary.
  const uint32_t base_address = ptx::smem_address(dynamic_smem);
  uint8_t* aligned_base = dynamic_smem + ((Layout::kAlignment - base_address % Layout::kAlignment) %
                                          Layout::kAlignment);
  const typename Loop::Storage smem = Loop::Storage::carve(aligned_base);

  const int warpgroup_idx = warpgroup_index();
  const WarpgroupRole role = warpgroup_role();

  if (threadIdx.x == 0) {
    ptx::prefetch_tensor_map(&map_a);
    ptx::prefetch_tensor_map(&map_b);
    for (int stage = 0; stage < Layout::kNumStages; ++stage) {
      ptx::mbarrier_init(&smem.full[stage], 1);
      ptx::mbarrier_init(&smem.empty[stage], 4);  // the 4 warps of the stage's one consumer
    }
    ptx::mbarrier_init(smem.tail, 1);
    ptx::fence_barrier_init();
  }
  __syncthreads();

  GroupedTileScheduler<kKind, PingpongConfig<kBlockM>, 1, /*kRotateRounds=*/false> scheduler(
      params);
  GroupedTile tile;
  typename Loop::State state;
  if (role == WarpgroupRole::kProducer) {
    ptx::setmaxnreg_decrease<kProducerRegisters>();
    if (threadIdx.x / 32 == 0) {
      uint32_t tail_phase = 0;
      while (scheduler.next_tile(tile)) {
        Loop::load(&map_a, &map_b, smem, params, tile, state, tail_phase);
      }
    }
  } else {
    ptx::setmaxnreg_increase<kConsumerRegisters>();
    const int consumer_idx = warpgroup_idx - 1;
    const uint32_t my_turn = static_cast<uint32_t>(NamedBarrier::kMainloopTurn0) + consumer_idx;
    const uint32_t other_turn =
        static_cast<uint32_t>(NamedBarrier::kMainloopTurn0) + (1 - consumer_idx);
    constexpr uint32_t kTurnThreads = 2 * 128;  // the waiting consumer and the one handing over
    uint8_t* staging = smem.consumer_staging(consumer_idx);
    typename Store::Accumulators accum;  // (BLOCK_M, BLOCK_N) tile of this warpgroup
    for (int tile_count = 0; scheduler.next_tile(tile); ++tile_count) {
      if (tile_count % 2 == consumer_idx) {
        Store::init(params, tile, accum);
        if (tile_count > 0) ptx::named_barrier_sync(my_turn, kTurnThreads);
        const int in_flight_stage = Loop::mma(smem, params, tile, state, accum);
        // Every stage of this tile has been waited on: the other consumer may start its mainloop
        // (it waits for this hand-over only when it has a tile to start).
        if (scheduler.has_next_tile()) ptx::named_barrier_arrive(other_turn, kTurnThreads);
        Loop::mma_tail(smem, in_flight_stage, accum);
        Store::store(params, tile, staging, accum);
      } else {
        Loop::skip(state, Loop::num_k_blocks(params, tile));
      }
    }
  }
#endif
}

}  // namespace mok::gemm
