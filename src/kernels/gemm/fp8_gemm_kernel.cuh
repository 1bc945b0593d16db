// The persistent FP8 blockwise-scaled grouped GEMM (forward, which also runs the dgrad on the
// transposed weight, and wgrad): one CTA per SM, one producer warpgroup (one warp issues TMA and
// the scales' cp.async; with the wgrad's bf16 gradients a second one stores the staged tiles) and
// two consumer warpgroups (wgmma on E4M3, per-k-block promotion), tiles from the grouped tile
// scheduler in the bf16 engine's order. The forward may run on clusters of
// kFp8ClusterSize CTAs that share the weight tile (Fp8Scheduler).
#pragma once

#include <cuda.h>

#include "kernels/gemm/fp8_epilogue.cuh"
#include "kernels/gemm/fp8_gemm_types.cuh"
#include "kernels/gemm/fp8_mainloop.cuh"
#include "kernels/gemm/fp8_tile_scheduler.cuh"
#include "kernels/gemm/kernel_roles.cuh"
#include "kernels/gemm/tile_scheduler.cuh"
#include "kernels/ptx/barrier.cuh"
#include "kernels/ptx/tma.cuh"

namespace mok::gemm {

// Register split: the consumers hold 128 accumulators and 64 partial sums each (ptxas gives the
// code after setmaxnreg.inc that budget, not the launch bound's 168).
constexpr uint32_t kFp8ProducerRegisters = 40;
constexpr uint32_t kFp8ConsumerRegisters = 232;
static_assert(register_split_fits(kFp8ProducerRegisters, kFp8ConsumerRegisters,
                                  Fp8TileConfig::kNumConsumerWarpgroups),
              "the FP8 kernel's register split exceeds the SM's register file");

// The dynamic shared memory's base needs more alignment padding than the layout's slack.
inline __device__ __noinline__ void fp8_shared_base_misaligned() { __trap(); }

// kStages, kClusterSize: Fp8SharedLayout's; kClusterSize > 1 (forward only) is launched on
// clusters of that many CTAs, with map_b's box one 128-column piece of the weight tile. map_c:
// wgrad's bf16 output as a tensor map for the store warp's tile stores (Fp8Epilogue::store_tile).
// kGateUp: kSwiGluFp8 also stores the gate/up sums in bf16 (Fp8GemmParams::gate_up).
template <EpilogueKind kEpilogue, GemmKind kKind = GemmKind::kForward,
          int kStages = fp8_stages(kKind, kEpilogue), int kClusterSize = 1, bool kGateUp = false>
__global__ void __launch_bounds__(Fp8TileConfig::kNumThreads, 1)
    fp8_grouped_gemm_kernel(const __grid_constant__ CUtensorMap map_a,
                            const __grid_constant__ CUtensorMap map_b,
                            const __grid_constant__ CUtensorMap map_c, const Fp8GemmParams params) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using Layout = Fp8SharedLayout<kEpilogue, kKind, kStages, kClusterSize>;
  using Loop = Fp8Mainloop<Layout>;
  using Store = Fp8Epilogue<kEpilogue, kKind, kGateUp>;
  extern __shared__ __align__(1024) uint8_t dynamic_smem[];
  // NOTE: the 128-byte swizzle pattern repeats every 1024 B; the descriptors assume stage
  // buffers start on that boundary. On a cluster the padding is the same in every CTA, so that
  // the multicasts land at the same offsets.
  const uint32_t base_address = ptx::smem_address(dynamic_smem);
  const uint32_t padding =
      (Layout::kAlignment - base_address % Layout::kAlignment) % Layout::kAlignment;
  if (padding > Layout::kAlignmentSlack) fp8_shared_base_misaligned();
  const typename Loop::Storage smem = Loop::Storage::carve(dynamic_smem + padding);
  static_assert(Store::kBoxStores == Layout::kTileStaging &&
                    (!Store::kBoxStores || Store::Boxes::kBytes == Layout::kStagingBytes),
                "the layout stages the tiles the epilogue stores");
  [[maybe_unused]] const typename Store::Boxes::Staging staging = {smem.staging, smem.staged,
                                                                   smem.staging_free};

  if (threadIdx.x == 0) {
    ptx::prefetch_tensor_map(&map_a);
    ptx::prefetch_tensor_map(&map_b);
    if constexpr (Store::kBoxStores) {
      ptx::prefetch_tensor_map(&map_c);
      Store::Boxes::init_barriers(staging);
    }
    Loop::init_barriers(smem);  // (its fence publishes the staging's barriers too)
  }
  // NOTE: on a cluster, no CTA may multicast into (or arrive on) a peer's barriers before the
  // peer has initialised them.
  if constexpr (kClusterSize > 1) {
    ptx::cluster_sync();
  } else {
    __syncthreads();
  }

  Fp8Scheduler<kKind, kClusterSize> scheduler(params.grouped);
  GroupedTile tile;
  typename Loop::State state;
  if (warpgroup_role() == WarpgroupRole::kProducer) {
    ptx::setmaxnreg_decrease<kFp8ProducerRegisters>();
    if (threadIdx.x / 32 == 0) {
      while (scheduler.next_tile(tile)) Loop::load(&map_a, &map_b, smem, params, tile, state);
      Loop::drain_loads(smem, state);
    }
    if constexpr (Store::kBoxStores) {
      if (threadIdx.x / 32 == 1) {
        for (uint32_t stored = 0; scheduler.next_tile(tile); ++stored) {
          Store::store_tile(tile, staging, stored, &map_c);
        }
        Store::Boxes::drain();
      }
    }
  } else {
    ptx::setmaxnreg_increase<kFp8ConsumerRegisters>();
    const int consumer_idx = warpgroup_index() - 1;
    float accum[Loop::kNumAccumulators];  // (64, BLOCK_N) fragment of this warpgroup, promoted
    // One piece's k-block sums. NOTE: no initial values: every group's first wgmma step ignores
    // them (scale-d 0), and copies into these registers would make ptxas serialize the wgmma.
    float partial[Loop::kPieceAccumulators];
    if constexpr (Loop::kLookahead) {
      static_assert(Store::kBoxStores, "the lookahead's epilogue stages tiles");
      // Each tile's first wgmma group runs while the previous tile's accumulators are staged; the
      // code between its issue and its wait has no branch (ptxas would wait at one), so the wait
      // for the staging comes before the issue.
      if (scheduler.next_tile(tile)) {
        Store::init(params.grouped, tile, consumer_idx, accum);
        Loop::mma(smem, params, tile, consumer_idx, state, accum, partial, false);
        GroupedTile next;
        uint32_t stored = 0;
        while (scheduler.next_tile(next)) {
          Store::Boxes::wait_free(staging, stored++);
          const bool issued = Loop::issue_first(smem, params, next, consumer_idx, state, partial);
          Store::stage_tile(consumer_idx, staging, accum);
          Store::init(params.grouped, next, consumer_idx, accum);
          ptx::wgmma_wait_group<0>();
          Loop::mma(smem, params, next, consumer_idx, state, accum, partial, issued);
          tile = next;
        }
        Store::Boxes::wait_free(staging, stored);
        Store::stage_tile(consumer_idx, staging, accum);
      }
    } else {
      while (scheduler.next_tile(tile)) {
        if (kClusterSize > 1 && fp8_is_empty_tile(tile)) {
          Loop::skip(smem, params, tile, state);
          continue;
        }
        Store::init(params.grouped, tile, consumer_idx, accum);
        Loop::mma(smem, params, tile, consumer_idx, state, accum, partial, false);
        Store::store(params.grouped, tile, consumer_idx, smem.staging, accum, params.gate_up,
                     params.gate_up_rows);
      }
    }
  }
#endif
}

}  // namespace mok::gemm
