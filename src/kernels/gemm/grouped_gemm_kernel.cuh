// The standalone persistent grouped GEMM: one CTA per SM, one producer warpgroup and two consumer
// warpgroups, tiles from the grouped tile scheduler. The megakernel composes the same mainloop,
// epilogue and scheduler per task; this entry point serves the launchers, tests and benchmarks.
#pragma once

#include <cuda.h>

#include "kernels/gemm/epilogue.cuh"
#include "kernels/gemm/gemm_types.cuh"
#include "kernels/gemm/kernel_roles.cuh"
#include "kernels/gemm/mainloop.cuh"
#include "kernels/gemm/tile_scheduler.cuh"
#include "kernels/ptx/barrier.cuh"
#include "kernels/ptx/tma.cuh"

namespace mok::gemm {

// Register split: the producer needs few, the consumers hold (64, 256) fp32 accumulators each.
constexpr uint32_t kProducerRegisters = 40;
constexpr uint32_t kConsumerRegisters = 232;
static_assert(register_split_fits(kProducerRegisters, kConsumerRegisters,
                                  TileConfig::kNumConsumerWarpgroups),
              "the cooperative kernel's register split exceeds the SM's register file");

// map_c: wgrad's bf16 output as a tensor map for the epilogue's tile stores (store_holding);
// unused by the other kinds. kClusterSize > 1 (wgrad): launched on clusters of that many CTAs,
// which share B's loads (kWgradClusterSize).
template <GemmKind kKind, EpilogueKind kEpilogue, int kClusterSize = 1>
__global__ void __launch_bounds__(TileConfig::kNumThreads, 1)
    grouped_gemm_kernel(const __grid_constant__ CUtensorMap map_a,
                        const __grid_constant__ CUtensorMap map_b,
                        const __grid_constant__ CUtensorMap map_c, const GroupedGemmParams params) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using Layout = CooperativeLayout<kKind, kEpilogue, kClusterSize>;
  using Loop = Mainloop<kKind, Layout>;
  using Store = Epilogue<kKind, kEpilogue>;
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
    if constexpr (Store::kBoxStores) ptx::prefetch_tensor_map(&map_c);
    for (int stage = 0; stage < Layout::kNumStages; ++stage) {
      ptx::mbarrier_init(&smem.full[stage], 1);
      // Every consumer warp of every CTA whose multicast writes into the stage.
      ptx::mbarrier_init(&smem.empty[stage], TileConfig::kNumConsumerWarpgroups * 4 * kClusterSize);
    }
    for (int tail = 0; tail < Layout::kNumTailBarriers; ++tail) {
      ptx::mbarrier_init(&smem.tail[tail], 1);
    }
    ptx::fence_barrier_init();
  }
  // NOTE: in a cluster, no CTA may multicast into (or arrive on) a peer's barriers before the
  // peer has initialised them.
  if constexpr (kClusterSize > 1) {
    ptx::cluster_sync();
  } else {
    __syncthreads();
  }

  GroupedTileScheduler<kKind, TileConfig, kClusterSize> scheduler(params);
  GroupedTile tile;
  typename Loop::State state;
  if (role == WarpgroupRole::kProducer) {
    ptx::setmaxnreg_decrease<kProducerRegisters>();
    uint32_t tail_phase = 0;
    if (threadIdx.x / 32 == 0) {
      while (scheduler.next_tile(tile)) {
        Loop::load(&map_a, &map_b, smem, params, tile, state, tail_phase);
      }
    }
    if constexpr (Loop::kTailsApart) {
      if (threadIdx.x / 32 == 1) {
        while (scheduler.next_tile(tile)) {
          Loop::publish_tails(smem, params, tile, state, tail_phase);
        }
      }
    }
  } else {
    ptx::setmaxnreg_increase<kConsumerRegisters>();
    const int consumer_idx = warpgroup_idx - 1;
    float accum[Store::kNumAccumulators];  // (64, BLOCK_N) fragment of this warpgroup
    if constexpr (Store::kBoxStores) {
      // Each tile's last boxes leave once the next tile's second k-block group is issued, under
      // its MMAs (Store::store_holding).
      typename Store::HeldBoxes held;
      const typename Store::HeldBoxesOut held_out(smem.staging, consumer_idx, held, &map_c);
      bool holding = false;
      while (scheduler.next_tile(tile)) {
        Store::init(params, tile, consumer_idx, accum);
        if (holding) {
          Loop::mma_full_tile_with(smem, params, tile, consumer_idx, state, accum, held_out);
        } else {
          Loop::mma(smem, params, tile, consumer_idx, state, accum);
        }
        Store::store_holding(params, tile, consumer_idx, smem.staging, accum, &map_c, held);
        holding = true;
      }
      if (holding) held_out.write();
    } else {
      while (scheduler.next_tile(tile)) {
        Store::init(params, tile, consumer_idx, accum);
        Loop::mma(smem, params, tile, consumer_idx, state, accum);
        if constexpr (kKind == GemmKind::kWgrad) {
          Store::store(params, tile, consumer_idx, smem.staging, accum);
        } else {
          Store::store(params, tile, consumer_idx, smem.staging, accum,
                       Store::RowMajorRows::of(params));
        }
      }
    }
    Store::drain();
  }
  // NOTE: a CTA's shared memory must outlive the peers' last arrivals on its empty barriers.
  if constexpr (kClusterSize > 1) ptx::cluster_sync();
#endif
}

}  // namespace mok::gemm
