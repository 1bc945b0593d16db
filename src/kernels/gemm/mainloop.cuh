// The Hopper mainloop: a producer warp streams (A, B) k-blocks into the stage ring with TMA, and
// each consumer warpgroup multiplies its 64 rows of A by the whole B tile with wgmma.
//
// Stage s holds A (BLOCK_M, BLOCK_K) and B (BLOCK_N, BLOCK_K) in the layout TMA writes with the
// 128-byte swizzle: K-major as (rows, 64 k), MN-major as 64-wide chunks of (64 k, 64 mn).
// full[s] completes when the stage's bytes have landed; empty[s] when all consumer warps are done
// reading it. K-blocks run in natural order, so each output's sum has one fixed order.
#pragma once

#include <cuda.h>

#include "kernels/gemm/gemm_types.cuh"
#include "kernels/ptx/barrier.cuh"
#include "kernels/ptx/tma.cuh"
#include "kernels/ptx/wgmma.cuh"
#include "kernels/schedule/tile_scheduler.cuh"

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

template <class Layout>
struct SharedStorage {
  uint8_t* a;        // (kNumStages, BLOCK_M, BLOCK_K) bf16, swizzled
  uint8_t* b;        // (kNumStages, BLOCK_N, BLOCK_K) bf16, swizzled
  uint8_t* staging;  // (BLOCK_M, kStagingPitch bytes): the bf16 output tile on its way out
  uint64_t* full;    // (kNumStages)
  uint64_t* empty;   // (kNumStages)
  uint64_t* tail;    // staging barrier of the wgrad row tail

  __device__ static SharedStorage carve(uint8_t* aligned_base) {
    auto* barriers = reinterpret_cast<uint64_t*>(aligned_base + Layout::kBarrierOffset);
    return {aligned_base + Layout::kAOffset, aligned_base + Layout::kBOffset,
            aligned_base + Layout::kStagingOffset, barriers, barriers + Layout::kNumStages,
            barriers + 2 * Layout::kNumStages};
  }
  __device__ uint8_t* a_stage(int stage) const { return a + stage * TileConfig::kABytes; }
  __device__ uint8_t* b_stage(int stage) const { return b + stage * TileConfig::kBBytes; }
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
  // MN-major: the distance between 64-wide chunks; K-major swizzled operands do not use it.
  static constexpr uint32_t kALeadingBytes = kAMajorMN ? Config::kChunkBytes : 0;
  static constexpr uint32_t kBLeadingBytes = kBMajorMN ? Config::kChunkBytes : 0;

  __device__ static int num_k_blocks(const GroupedGemmParams& params, const GroupedTile& tile) {
    return ceil_div(kKind == GemmKind::kWgrad ? tile.row_count : params.k, Config::BLOCK_K);
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
      for (int chunk = 0; chunk < Config::BLOCK_M / Config::kChunk; ++chunk) {
        ptx::tma_load_2d(a + chunk * Config::kChunkBytes, map_a, barrier,
                         tile.m_block * Config::BLOCK_M + chunk * Config::kChunk, row);
      }
      for (int chunk = 0; chunk < Config::BLOCK_N / Config::kChunk; ++chunk) {
        ptx::tma_load_2d(b + chunk * Config::kChunkBytes, map_b, barrier,
                         tile.n_block * Config::BLOCK_N + chunk * Config::kChunk, row);
      }
    } else {
      ptx::tma_load_2d(a, map_a, barrier, k, tile.row_begin + tile.m_block * Config::BLOCK_M);
      if constexpr (kKind == GemmKind::kForward) {
        ptx::tma_load_3d(b, map_b, barrier, k, tile.n_block * Config::BLOCK_N, tile.group);
      } else {
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
                              const GroupedTile& tile, State& state,
                              uint32_t& tail_phase) {
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
    const int num_vectors = kNumChunks * (Config::BLOCK_K - valid_rows) * kLineVectors;
    for (int vector_idx = lane_idx; vector_idx < num_vectors; vector_idx += 32) {
      const int per_chunk = (Config::BLOCK_K - valid_rows) * kLineVectors;
      const int chunk = vector_idx / per_chunk;
      const int row = valid_rows + (vector_idx % per_chunk) / kLineVectors;
      const int column = vector_idx % kLineVectors;
      uint8_t* base = chunk < kNumAChunks
                          ? smem.a_stage(stage) + chunk * Config::kChunkBytes
                          : smem.b_stage(stage) + (chunk - kNumAChunks) * Config::kChunkBytes;
      reinterpret_cast<uint4*>(base + row * 128)[column] = make_uint4(0, 0, 0, 0);
    }
  }

  // dgrad and wgrad keep one k-block's wgmma group in flight while the next one is issued (the
  // tensor pipe does not drain between k-blocks; a stage goes back to the producer once the group
  // that read it has completed). Measured side by side on H200 (perf-notes/gemm.md): +4-7 % on
  // the short-K qwen3-30b dgrad/wgrad, within ~1 % elsewhere; but -2-3 % on the long-K forward
  // GEMMs, whose 3-stage ring then prefetches one k-block less, so the forward drains each
  // k-block. The k order, hence every sum, is the same either way.
  static constexpr bool kGroupInFlight = kKind != GemmKind::kForward;

  // Consumer side: accumulates this warpgroup's (64, BLOCK_N) slice of the tile into `accum`.
  __device__ static void mma(const Storage& smem, const GroupedGemmParams& params,
                             const GroupedTile& tile, int consumer_idx, State& state,
                             float (&accum)[Mma::kNumAccumulators]) {
    const int lane_idx = static_cast<int>(threadIdx.x % 32);
    const int num_blocks = num_k_blocks(params, tile);
    int previous_stage = -1;
    for (int k_block = 0; k_block < num_blocks; ++k_block) {
      ptx::mbarrier_wait(&smem.full[state.index], state.phase);
      const uint32_t a_base = ptx::smem_address(smem.a_stage(state.index)) +
                              consumer_idx * (Config::kABytes / Config::kNumConsumerWarpgroups);
      const uint32_t b_base = ptx::smem_address(smem.b_stage(state.index));
#pragma unroll
      for (int i = 0; i < Mma::kNumAccumulators; ++i) ptx::fence_operand(accum[i]);
      ptx::wgmma_fence();
#pragma unroll
      for (int k16 = 0; k16 < Config::BLOCK_K / 16; ++k16) {
        // K-major: +32 B per 16 k inside the swizzle row; MN-major: +16 rows of 128 B.
        const uint32_t a_step = kAMajorMN ? k16 * 2048 : k16 * 32;
        const uint32_t b_step = kBMajorMN ? k16 * 2048 : k16 * 32;
        const uint64_t desc_a = ptx::make_smem_descriptor(a_base + a_step, kALeadingBytes, 1024);
        const uint64_t desc_b = ptx::make_smem_descriptor(b_base + b_step, kBLeadingBytes, 1024);
        Mma::mma(desc_a, desc_b, 1u, accum);
      }
      ptx::wgmma_commit_group();
      if constexpr (kGroupInFlight) {
        ptx::wgmma_wait_group<1>();  // the previous k-block's group has completed
      } else {
        ptx::wgmma_wait_group<0>();
      }
#pragma unroll
      for (int i = 0; i < Mma::kNumAccumulators; ++i) ptx::fence_operand(accum[i]);
      const int done_stage = kGroupInFlight ? previous_stage : state.index;
      if (lane_idx == 0 && done_stage >= 0) ptx::mbarrier_arrive(&smem.empty[done_stage]);
      previous_stage = state.index;
      state.advance();
    }
    if constexpr (kGroupInFlight) {
      ptx::wgmma_wait_group<0>();
#pragma unroll
      for (int i = 0; i < Mma::kNumAccumulators; ++i) ptx::fence_operand(accum[i]);
      if (lane_idx == 0 && previous_stage >= 0) ptx::mbarrier_arrive(&smem.empty[previous_stage]);
    }
  }
};

}  // namespace mok::gemm
