// The ping-pong engine's mainloop: a producer warp streams (A, B) k-blocks of every tile of the
// CTA into the stage ring with TMA; the consumer warpgroup that owns a tile multiplies its
// (BLOCK_M, BLOCK_N) block with BLOCK_M / 64 wgmma m64nBLOCK_Nk16 per k16 step, sharing B.
//
// Stage s holds A (BLOCK_M, BLOCK_K) and B (BLOCK_N, BLOCK_K) as TMA writes them with the
// 128-byte swizzle: K-major as (rows, 64 k), MN-major as 64-wide chunks of (64 k, 64 mn).
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
#include "kernels/ptx/barrier.cuh"
#include "kernels/ptx/tma.cuh"
#include "kernels/ptx/wgmma.cuh"
#include "kernels/schedule/tile_scheduler.cuh"

namespace mok::gemm {

template <class Layout>
struct PingpongStorage {
  using Config = typename Layout::Config;
  uint8_t* a;        // (kNumStages, BLOCK_M, BLOCK_K) bf16, swizzled
  uint8_t* b;        // (kNumStages, BLOCK_N, BLOCK_K) bf16, swizzled
  uint8_t* staging;  // (kNumConsumerWarpgroups, BLOCK_M, kStagingPitch bytes)
  uint64_t* full;    // (kNumStages)
  uint64_t* empty;   // (kNumStages)
  uint64_t* tail;    // staging barrier of the wgrad row tail

  __device__ static PingpongStorage carve(uint8_t* aligned_base) {
    auto* barriers = reinterpret_cast<uint64_t*>(aligned_base + Layout::kBarrierOffset);
    return {aligned_base + Layout::kAOffset, aligned_base + Layout::kBOffset,
            aligned_base + Layout::kStagingOffset, barriers, barriers + Layout::kNumStages,
            barriers + 2 * Layout::kNumStages};
  }
  __device__ uint8_t* a_stage(int stage) const { return a + stage * Config::kABytes; }
  __device__ uint8_t* b_stage(int stage) const { return b + stage * Config::kBBytes; }
  __device__ uint8_t* consumer_staging(int consumer_idx) const {
    return staging + consumer_idx * Layout::kStagingBytesPerConsumer;
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
  // MN-major: the distance between 64-wide chunks; K-major swizzled operands do not use it.
  static constexpr uint32_t kALeadingBytes = kAMajorMN ? Config::kChunkBytes : 0;
  static constexpr uint32_t kBLeadingBytes = kBMajorMN ? Config::kChunkBytes : 0;

  __device__ static int num_k_blocks(const GroupedGemmParams& params, const GroupedTile& tile) {
    return ceil_div(kKind == GemmKind::kWgrad ? tile.row_count : params.k, Config::BLOCK_K);
  }

  // Moves `state` past the k-blocks of a tile the other consumer owns.
  __device__ static void skip(State& state, int num_blocks) {
    const int position = state.index + num_blocks;
    state.index = position % Layout::kNumStages;
    state.phase ^= static_cast<uint32_t>(position / Layout::kNumStages) & 1u;
  }

  // Issues the TMA copies of one k-block into stage `stage`, completing on `barrier`.
  __device__ static void issue_loads(const CUtensorMap* map_a, const CUtensorMap* map_b,
                                     const Storage& smem, int stage, uint64_t* barrier,
                                     const GroupedTile& tile, int k_block) {
    uint8_t* a = smem.a_stage(stage);
    uint8_t* b = smem.b_stage(stage);
    const int k = k_block * Config::BLOCK_K;
    if constexpr (kKind == GemmKind::kWgrad) {
      const int row = tile.row_begin + k;
#pragma unroll
      for (int chunk = 0; chunk < Config::BLOCK_M / Config::kChunk; ++chunk) {
        ptx::tma_load_2d(a + chunk * Config::kChunkBytes, map_a, barrier,
                         tile.m_block * Config::BLOCK_M + chunk * Config::kChunk, row);
      }
#pragma unroll
      for (int chunk = 0; chunk < Config::BLOCK_N / Config::kChunk; ++chunk) {
        ptx::tma_load_2d(b + chunk * Config::kChunkBytes, map_b, barrier,
                         tile.n_block * Config::BLOCK_N + chunk * Config::kChunk, row);
      }
    } else {
      ptx::tma_load_2d(a, map_a, barrier, k, tile.row_begin + tile.m_block * Config::BLOCK_M);
      if constexpr (kKind == GemmKind::kForward) {
        ptx::tma_load_3d(b, map_b, barrier, k, tile.n_block * Config::BLOCK_N, tile.group);
      } else {
#pragma unroll
        for (int chunk = 0; chunk < Config::BLOCK_N / Config::kChunk; ++chunk) {
          ptx::tma_load_3d(b + chunk * Config::kChunkBytes, map_b, barrier,
                           tile.n_block * Config::BLOCK_N + chunk * Config::kChunk, k, tile.group);
        }
      }
    }
  }

  // Producer side, run by all 32 lanes of the producer warp (lane 0 issues). Returns after the
  // copies of every k-block of `tile` have been issued.
  __device__ static void load(const CUtensorMap* map_a, const CUtensorMap* map_b,
                              const Storage& smem, const GroupedGemmParams& params,
                              const GroupedTile& tile, State& state, uint32_t& tail_phase) {
    const int lane_idx = static_cast<int>(threadIdx.x % 32);
    const int num_blocks = num_k_blocks(params, tile);
    for (int k_block = 0; k_block < num_blocks; ++k_block) {
      ptx::mbarrier_wait(&smem.empty[state.index], state.phase ^ 1u);
      const int valid_rows = tile.row_count - k_block * Config::BLOCK_K;
      if (kKind == GemmKind::kWgrad && valid_rows < Config::BLOCK_K) {
        // NOTE: the rows past the group's end belong to the next group (TMA only zero-fills past
        // the tensor), so the tail block is staged, its extra rows zeroed, then published.
        if (lane_idx == 0) {
          ptx::mbarrier_arrive_expect_tx(smem.tail, Config::kStageBytes);
          issue_loads(map_a, map_b, smem, state.index, smem.tail, tile, k_block);
        }
        ptx::mbarrier_wait(smem.tail, tail_phase);
        tail_phase ^= 1u;
        zero_tail_rows(smem, state.index, valid_rows, lane_idx);
        ptx::fence_proxy_async_shared();
        __syncwarp();
        if (lane_idx == 0) ptx::mbarrier_arrive(&smem.full[state.index]);
      } else if (lane_idx == 0) {
        ptx::mbarrier_arrive_expect_tx(&smem.full[state.index], Config::kStageBytes);
        issue_loads(map_a, map_b, smem, state.index, &smem.full[state.index], tile, k_block);
      }
      __syncwarp();
      state.advance();
    }
  }

  // Rows [valid_rows, BLOCK_K) of every (64 k, 64 mn) chunk of the stage. A swizzled row is one
  // whole 128-byte line, so zeroing lines needs no knowledge of the swizzle.
  __device__ static void zero_tail_rows(const Storage& smem, int stage, int valid_rows,
                                        int lane_idx) {
    constexpr int kLineVectors = 128 / 16;
    constexpr int kNumAChunks = Config::BLOCK_M / Config::kChunk;
    constexpr int kNumChunks = kNumAChunks + Config::BLOCK_N / Config::kChunk;
    const int first_vector = valid_rows * kLineVectors;
#pragma unroll
    for (int chunk = 0; chunk < kNumChunks; ++chunk) {
      uint8_t* base = chunk < kNumAChunks
                          ? smem.a_stage(stage) + chunk * Config::kChunkBytes
                          : smem.b_stage(stage) + (chunk - kNumAChunks) * Config::kChunkBytes;
      // (BLOCK_K rows, 8 vectors of 16 B): row = vector / 8 is one swizzled 128-byte line.
      for (int vector_idx = first_vector + lane_idx; vector_idx < Config::BLOCK_K * kLineVectors;
           vector_idx += 32) {
        reinterpret_cast<uint4*>(base)[vector_idx] = make_uint4(0, 0, 0, 0);
      }
    }
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
