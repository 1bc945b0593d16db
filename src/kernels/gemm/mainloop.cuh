// The Hopper mainloop: a producer warp streams (A, B) k-blocks into the stage ring with TMA
// (tile_loader.cuh), and each consumer warpgroup multiplies its 64 rows of A by the whole B tile
// with wgmma. empty[s] completes when all consumer warps are done reading stage s. K-blocks run in
// natural order, so each output's sum has one fixed order.
#pragma once

#include <cuda.h>

#include "kernels/gemm/gemm_types.cuh"
#include "kernels/gemm/tile_loader.cuh"
#include "kernels/gemm/tile_scheduler.cuh"
#include "kernels/ptx/barrier.cuh"
#include "kernels/ptx/tma.cuh"
#include "kernels/ptx/wgmma.cuh"

namespace mok::gemm {

// Position in the stage ring; the phase flips each time the index wraps.
template <int kNumStages>
struct PipelineState {
  int index = 0;
  uint32_t phase = 0;
  __device__ void advance() {
    if (++index == kNumStages) {
      index = 0;
      phase ^= 1u;
    }
  }
};

// The buffers of a shared-memory layout (SharedLayout, PingpongSharedLayout), found from its
// offsets.
template <class Layout>
struct SharedStorage {
  using Config = typename Layout::Config;
  static constexpr int kClusterSize = Layout::kClusterSize;
  static constexpr int kNumTailBarriers = Layout::kNumTailBarriers;
  uint8_t* a;        // (kNumStages, BLOCK_M, BLOCK_K) bf16, swizzled
  uint8_t* b;        // (kNumStages, BLOCK_N, BLOCK_K) bf16, swizzled
  uint8_t* staging;  // the bf16 output tile(s) on their way out
  uint64_t* full;    // (kNumStages)
  uint64_t* empty;   // (kNumStages)
  uint64_t* tail;    // (Layout::kNumTailBarriers) staging barriers of the wgrad row tails

  __device__ static SharedStorage carve(uint8_t* aligned_base) {
    auto* barriers = reinterpret_cast<uint64_t*>(aligned_base + Layout::kBarrierOffset);
    return {aligned_base + Layout::kAOffset,       aligned_base + Layout::kBOffset,
            aligned_base + Layout::kStagingOffset, barriers,
            barriers + Layout::kNumStages,         barriers + 2 * Layout::kNumStages};
  }
  // The staging barrier of a row tail loaded into `stage`, and its bit in the tail phases (one
  // barrier per stage where the layout has one per stage, as wgrad's; else one for all).
  __device__ uint64_t* tail_barrier(int stage) const {
    return Layout::kNumTailBarriers > 1 ? tail + stage : tail;
  }
  __device__ static uint32_t tail_phase_bit(int stage) {
    return Layout::kNumTailBarriers > 1 ? 1u << stage : 1u;
  }
  __device__ uint8_t* a_stage(int stage) const { return a + stage * Config::kABytes; }
  __device__ uint8_t* b_stage(int stage) const { return b + stage * Config::kBBytes; }
};

template <GemmKind kKind, class Layout>
struct Mainloop {
  using Storage = SharedStorage<Layout>;
  using State = PipelineState<Layout::kNumStages>;
  using Config = TileConfig;
  static constexpr bool kAMajorMN = kKind == GemmKind::kWgrad;
  static constexpr bool kBMajorMN = kKind != GemmKind::kForward;
  using Mma = ptx::Wgmma64x256<kAMajorMN ? 1 : 0, kBMajorMN ? 1 : 0>;
  static_assert(Mma::kN == Config::BLOCK_N, "one wgmma spans the whole N tile");
  // MN-major: the distance between 64-wide panels; K-major swizzled operands do not use it.
  static constexpr uint32_t kALeadingBytes = kAMajorMN ? Config::kPanelBytes : 0;
  static constexpr uint32_t kBLeadingBytes = kBMajorMN ? Config::kPanelBytes : 0;

  using Loader = TileLoader<kKind, Config>;

  __device__ static int num_k_blocks(const GroupedGemmParams& params, const GroupedTile& tile) {
    return Loader::num_k_blocks(params, tile);
  }

  // Producer side (tile_loader.cuh), with `beside`'s loads in each stage. wgrad's tail blocks are
  // published by a second producer warp (publish_tails): the first never waits for a load.
  static constexpr bool kTailsApart = kKind == GemmKind::kWgrad;
  static_assert(!kTailsApart || Layout::kNumTailBarriers == Layout::kNumStages,
                "a tail barrier per stage");

  template <class Beside = NothingBesideLoads>
  __device__ static void load(const CUtensorMap* map_a, const CUtensorMap* map_b,
                              const Storage& smem, const GroupedGemmParams& params,
                              const GroupedTile& tile, State& state, uint32_t& tail_phase,
                              const Beside& beside = {}) {
    Loader::template load<kTailsApart>(map_a, map_b, smem, params, tile, state, tail_phase, beside);
  }

  // The second producer warp (kTailsApart), over the same tiles as load's.
  __device__ static void publish_tails(const Storage& smem, const GroupedGemmParams& params,
                                       const GroupedTile& tile, State& state,
                                       uint32_t& tail_phase) {
    Loader::publish_tails(smem, params, tile, state, tail_phase);
  }

  // dgrad keeps one k-block's wgmma group in flight while the next one is issued (the tensor pipe
  // does not drain between k-blocks; a stage goes back to the producer once the group that read
  // it has completed). The forward drains each k-block: with a group in flight its 3-stage ring
  // prefetches one k-block less, which its long K pays for. The wgrad drains too: at EP 1 its
  // tiles wait for their loads, and a stage handed back one k-block earlier is one more load in
  // flight. Measured on H200 in perf-notes/gemm.md and backward.md. The k order, hence every sum,
  // is the same either way.
  static constexpr bool kGroupInFlight = kKind == GemmKind::kDgrad;

  // What a consumer does besides the tile's own MMAs (nothing, by default): fence() on its
  // accumulators wherever the tile's are fenced, issue(stage, k16) after the tile's wgmma of
  // each k16 step, in the same wgmma group (carried_tail.cuh), and after_second_group() once the
  // tile's second k-block group is issued, while it runs (the first one of a one-block tile; at
  // the end of a tile with none): work that leaves the accumulators alone (the wgrad's held output
  // boxes, warp_boxes.cuh).
  struct NothingBeside {
    __device__ void fence() const {}
    __device__ void issue(int /*stage*/, int /*k16*/) const {}
    __device__ void after_second_group() const {}
  };

  // Consumer side: accumulates this warpgroup's (64, BLOCK_N) slice of the tile into `accum`; in
  // a half tile (is_half_tile), rows 0-63 of column half consumer_idx into accum[0, 64).
  __device__ static void mma(const Storage& smem, const GroupedGemmParams& params,
                             const GroupedTile& tile, int consumer_idx, State& state,
                             float (&accum)[Mma::kNumAccumulators]) {
    if (is_half_tile<kKind>(tile)) {
      // NOTE: the half tile's m64n128 covers the first 64 accumulators, in the same fragment
      // layout (fragment.cuh) as the first 128 columns of an m64n256.
      mma_k_blocks<HalfMma>(smem, params, tile, 0,
                            consumer_idx * (Config::kBBytes / Config::kNumConsumerWarpgroups),
                            state, reinterpret_cast<float(&)[HalfMma::kNumAccumulators]>(accum));
    } else {
      const NothingBeside nothing{};
      mma_full_tile_with(smem, params, tile, consumer_idx, state, accum, nothing);
    }
  }

  // mma() for a full tile (not a half one), with `beside`'s MMAs in each k16 step.
  template <class Beside>
  __device__ static void mma_full_tile_with(const Storage& smem, const GroupedGemmParams& params,
                                            const GroupedTile& tile, int consumer_idx, State& state,
                                            float (&accum)[Mma::kNumAccumulators], Beside& beside) {
    mma_k_blocks<Mma>(smem, params, tile,
                      consumer_idx * (Config::kABytes / Config::kNumConsumerWarpgroups), 0, state,
                      accum, beside);
  }

 private:
  using HalfMma = ptx::Wgmma64x128<kAMajorMN ? 1 : 0, kBMajorMN ? 1 : 0>;
  static_assert(2 * HalfMma::kN == Config::BLOCK_N, "a half tile's consumers split N in two");
  // Column half c of a stage's B tile starts kBBytes / 2 in: 128 K-major rows, or two 64-wide
  // MN-major panels.
  static_assert(Config::kBBytes / 2 == 2 * Config::kPanelBytes, "B halves are whole panels");

  static constexpr int kK16Steps = Config::BLOCK_K / 16;
  static_assert(kK16Steps == 4, "mma_k_blocks' wgrad steps: 1 to 4");

  // The first kSteps k16 steps of a stage's k-block, with `beside`'s after each.
  template <class Shape, int kSteps, class Beside>
  __device__ static void issue_k16_steps(uint32_t a_base, uint32_t b_base, int stage,
                                         float (&accum)[Shape::kNumAccumulators], Beside& beside) {
#pragma unroll
    for (int k16 = 0; k16 < kSteps; ++k16) {
      // K-major: +32 B per 16 k inside the swizzle row; MN-major: +16 rows of 128 B.
      const uint32_t a_step = kAMajorMN ? k16 * 2048 : k16 * 32;
      const uint32_t b_step = kBMajorMN ? k16 * 2048 : k16 * 32;
      const uint64_t desc_a = ptx::make_smem_descriptor(a_base + a_step, kALeadingBytes, 1024);
      const uint64_t desc_b = ptx::make_smem_descriptor(b_base + b_step, kBLeadingBytes, 1024);
      Shape::mma(desc_a, desc_b, 1u, accum);
      beside.issue(stage, k16);
    }
  }

  // The k-loop of one tile with wgmma shape Shape, A and B read from the given byte offsets
  // into each stage.
  template <class Shape, class Beside = const NothingBeside>
  __device__ static void mma_k_blocks(const Storage& smem, const GroupedGemmParams& params,
                                      const GroupedTile& tile, uint32_t a_offset, uint32_t b_offset,
                                      State& state, float (&accum)[Shape::kNumAccumulators],
                                      Beside& beside = NothingBeside{}) {
    const int lane_idx = static_cast<int>(threadIdx.x % 32);
    const int num_blocks = num_k_blocks(params, tile);
    int previous_stage = -1;
    for (int k_block = 0; k_block < num_blocks; ++k_block) {
      ptx::mbarrier_wait(&smem.full[state.index], state.phase);
      const uint32_t a_base = ptx::smem_address(smem.a_stage(state.index)) + a_offset;
      const uint32_t b_base = ptx::smem_address(smem.b_stage(state.index)) + b_offset;
#pragma unroll
      for (int i = 0; i < Shape::kNumAccumulators; ++i) ptx::fence_operand(accum[i]);
      beside.fence();
      ptx::wgmma_fence();
      if constexpr (kKind == GemmKind::kWgrad) {
        // A group's last block: only the k16 steps over its rows (the loader zeroes the rest of
        // the last step's rows). NOTE: one unrolled sequence per step count, chosen before the
        // first wgmma: a condition on each wgmma makes ptxas serialize them.
        switch (Loader::k16_steps(tile, k_block)) {
          case 1:
            issue_k16_steps<Shape, 1>(a_base, b_base, state.index, accum, beside);
            break;
          case 2:
            issue_k16_steps<Shape, 2>(a_base, b_base, state.index, accum, beside);
            break;
          case 3:
            issue_k16_steps<Shape, 3>(a_base, b_base, state.index, accum, beside);
            break;
          default:
            issue_k16_steps<Shape, kK16Steps>(a_base, b_base, state.index, accum, beside);
            break;
        }
      } else {
        issue_k16_steps<Shape, kK16Steps>(a_base, b_base, state.index, accum, beside);
      }
      ptx::wgmma_commit_group();
      if (k_block == (num_blocks > 1 ? 1 : 0)) beside.after_second_group();
      if constexpr (kGroupInFlight) {
        ptx::wgmma_wait_group<1>();  // the previous k-block's group has completed
      } else {
        ptx::wgmma_wait_group<0>();
      }
#pragma unroll
      for (int i = 0; i < Shape::kNumAccumulators; ++i) ptx::fence_operand(accum[i]);
      beside.fence();
      const int done_stage = kGroupInFlight ? previous_stage : state.index;
      if (done_stage >= 0) release(smem, done_stage, lane_idx);
      previous_stage = state.index;
      state.advance();
    }
    if constexpr (kGroupInFlight) {
      ptx::wgmma_wait_group<0>();
#pragma unroll
      for (int i = 0; i < Shape::kNumAccumulators; ++i) ptx::fence_operand(accum[i]);
      beside.fence();
      if (previous_stage >= 0) release(smem, previous_stage, lane_idx);
    }
    if (num_blocks == 0) beside.after_second_group();
  }

  // A consumer warp is done reading `stage`: lane 0 hands it back to the producer; in a cluster,
  // lane r to CTA r's, whose multicast writes into this CTA's copy too.
  __device__ static void release(const Storage& smem, int stage, int lane_idx) {
    if constexpr (Layout::kClusterSize > 1) {
      if (lane_idx < Layout::kClusterSize) {
        ptx::mbarrier_arrive_cluster(&smem.empty[stage], static_cast<uint32_t>(lane_idx));
      }
    } else {
      if (lane_idx == 0) ptx::mbarrier_arrive(&smem.empty[stage]);
    }
  }
};

}  // namespace mok::gemm
