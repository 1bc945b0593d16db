// The ping-pong engine's mainloop: a producer warp streams (A, B) k-blocks of every tile of the
// CTA into the stage ring with TMA; the consumer warpgroup that owns a tile multiplies its
// (BLOCK_M, BLOCK_N) block with BLOCK_M / 64 wgmma m64nBLOCK_Nk16 per k16 step, sharing B.
//
// Stage s holds A (BLOCK_M, BLOCK_K) and B (BLOCK_N, BLOCK_K) as TMA writes them with the
// 128-byte swizzle: K-major as (rows, 64 k), MN-major as 64-wide panels of (64 k, 64 mn).
// The ring is consumed in tile order: a consumer skips the k-blocks of the other's tiles, and
// starts its mainloop only after the other has waited on every stage of its own (PingpongBarrier),
// so no consumer ever waits on a stage more than one lap ahead (at most two stages of the other
// are still unreleased then). K-blocks run in natural order.
#pragma once

#include <cuda.h>

#include <type_traits>

#include "kernels/gemm/gemm_types.cuh"
#include "kernels/gemm/mainloop.cuh"
#include "kernels/gemm/pingpong_types.cuh"
#include "kernels/gemm/tile_loader.cuh"
#include "kernels/gemm/tile_scheduler.cuh"
#include "kernels/ptx/barrier.cuh"
#include "kernels/ptx/tma.cuh"
#include "kernels/ptx/wgmma.cuh"

namespace mok::gemm {

// SharedStorage with one staging tile per consumer.
template <class Layout>
struct PingpongStorage : SharedStorage<Layout> {
  __device__ static PingpongStorage carve(uint8_t* aligned_base) {
    return {SharedStorage<Layout>::carve(aligned_base)};
  }
  __device__ uint8_t* consumer_staging(int consumer_idx) const {
    return this->staging + consumer_idx * Layout::kStagingBytesPerConsumer;
  }
};

template <GemmKind kKind, class Layout>
struct PingpongMainloop {
  using Storage = PingpongStorage<Layout>;
  using State = PipelineState<Layout::kNumStages>;
  using Config = typename Layout::Config;
  static constexpr bool kAMajorMN = kKind == GemmKind::kWgrad;
  static constexpr bool kBMajorMN = kKind != GemmKind::kForward;
  using Mma = std::conditional_t<Config::BLOCK_N == 256,
                                 ptx::Wgmma64x256<kAMajorMN ? 1 : 0, kBMajorMN ? 1 : 0>,
                                 ptx::Wgmma64x128<kAMajorMN ? 1 : 0, kBMajorMN ? 1 : 0>>;
  static_assert(Mma::kN == Config::BLOCK_N, "one wgmma spans the whole N tile");
  static constexpr int kNumRowBlocks = Config::BLOCK_M / 64;  // wgmma row blocks per tile
  static constexpr int kNumAccumulators = kNumRowBlocks * Mma::kNumAccumulators;
  // MN-major: the distance between 64-wide panels; K-major swizzled operands do not use it.
  static constexpr uint32_t kALeadingBytes = kAMajorMN ? Config::kPanelBytes : 0;
  static constexpr uint32_t kBLeadingBytes = kBMajorMN ? Config::kPanelBytes : 0;

  using Loader = TileLoader<kKind, Config>;

  __device__ static int num_k_blocks(const GroupedGemmParams& params, const GroupedTile& tile) {
    return Loader::num_k_blocks(params, tile);
  }

  // Moves `state` past the k-blocks of a tile the other consumer owns.
  __device__ static void skip(State& state, int num_blocks) {
    const int position = state.index + num_blocks;
    state.index = position % Layout::kNumStages;
    state.phase ^= static_cast<uint32_t>(position / Layout::kNumStages) & 1u;
  }

  // Producer side (tile_loader.cuh).
  __device__ static void load(const CUtensorMap* map_a, const CUtensorMap* map_b,
                              const Storage& smem, const GroupedGemmParams& params,
                              const GroupedTile& tile, State& state, uint32_t& tail_phase) {
    Loader::load(map_a, map_b, smem, params, tile, state, tail_phase);
  }

  // Consumer side: accumulates the whole (BLOCK_M, BLOCK_N) tile into this warpgroup's `accum`, row
  // block r (rows 64r .. 64r + 63) in accum[r]. One k-block's wgmma stay in flight while the
  // next one's are issued; a stage is released once the wgmma reading it have completed. Returns
  // with the last k-block's wgmma still in flight, on the returned stage (-1: none): mma_tail
  // completes them, after the hand-over to the other consumer, so that its wgmma queue behind
  // these without a gap.
  __device__ static int mma(const Storage& smem, const GroupedGemmParams& params,
                            const GroupedTile& tile, State& state,
                            float (&accum)[kNumRowBlocks][Mma::kNumAccumulators]) {
    const int lane_idx = static_cast<int>(threadIdx.x % 32);
    const int num_blocks = num_k_blocks(params, tile);
    int previous_stage = -1;
    for (int k_block = 0; k_block < num_blocks; ++k_block) {
      ptx::mbarrier_wait(&smem.full[state.index], state.phase);
      const uint32_t a_base = ptx::smem_address(smem.a_stage(state.index));
      const uint32_t b_base = ptx::smem_address(smem.b_stage(state.index));
      fence_accumulators(accum);
      ptx::wgmma_fence();
#pragma unroll
      for (int k16 = 0; k16 < Config::BLOCK_K / 16; ++k16) {
        // K-major: +32 B per 16 k inside the swizzle row; MN-major: +16 rows of 128 B.
        const uint32_t a_step = kAMajorMN ? k16 * 2048 : k16 * 32;
        const uint32_t b_step = kBMajorMN ? k16 * 2048 : k16 * 32;
        const uint64_t desc_b = ptx::make_smem_descriptor(b_base + b_step, kBLeadingBytes, 1024);
#pragma unroll
        for (int row_block = 0; row_block < kNumRowBlocks; ++row_block) {
          const uint64_t desc_a = ptx::make_smem_descriptor(
              a_base + row_block * Config::kRowBlockBytes + a_step, kALeadingBytes, 1024);
          Mma::mma(desc_a, desc_b, 1u, accum[row_block]);
        }
      }
      ptx::wgmma_commit_group();
      // The previous k-block's wgmma have completed: its stage can be refilled.
      ptx::wgmma_wait_group<1>();
      fence_accumulators(accum);
      if (previous_stage >= 0 && lane_idx == 0) ptx::mbarrier_arrive(&smem.empty[previous_stage]);
      previous_stage = state.index;
      state.advance();
    }
    return previous_stage;
  }

  // Completes the wgmma left in flight by mma and releases their stage.
  __device__ static void mma_tail(const Storage& smem, int in_flight_stage,
                                  float (&accum)[kNumRowBlocks][Mma::kNumAccumulators]) {
    ptx::wgmma_wait_group<0>();
    fence_accumulators(accum);
    if (in_flight_stage >= 0 && threadIdx.x % 32 == 0) {
      ptx::mbarrier_arrive(&smem.empty[in_flight_stage]);
    }
  }

 private:
  __device__ static void fence_accumulators(float (&accum)[kNumRowBlocks][Mma::kNumAccumulators]) {
#pragma unroll
    for (int row_block = 0; row_block < kNumRowBlocks; ++row_block) {
#pragma unroll
      for (int i = 0; i < Mma::kNumAccumulators; ++i) ptx::fence_operand(accum[row_block][i]);
    }
  }
};

}  // namespace mok::gemm
