// The producer side of both GEMM engines' mainloops (the cooperative one in mainloop.cuh, the
// ping-pong one in pingpong_mainloop.cuh): one warp streams each tile's (A, B) k-blocks into the
// stage ring with TMA, for a tile of Config's size; for wgrad a second warp may publish its tail
// blocks (load<kTailsApart>, publish_tails).
//
// Stage s holds A (BLOCK_M, BLOCK_K) and B (BLOCK_N, BLOCK_K) in the layout TMA writes with the
// 128-byte swizzle: K-major as (rows, 64 k), MN-major as 64-wide panels of (64 k, 64 mn).
// full[s] completes when the stage's bytes have landed. K-blocks run in natural order. On a
// cluster (wgrad, kWgradClusterSize), B's panels come by multicast, a share from each CTA.
#pragma once

#include <cuda.h>

#include "kernels/gemm/gemm_types.cuh"
#include "kernels/gemm/tile_scheduler.cuh"
#include "kernels/ptx/barrier.cuh"
#include "kernels/ptx/tma.cuh"

namespace mok::gemm {

// What a producer loads into each stage besides the tile's own operands (nothing, by default):
// kBytes more on the stage's full barrier, issued by issue(stage, barrier, k_block) after the
// tile's copies (the fused forward's carried tails, megakernel/carried_tails.cuh). Forward only.
struct NothingBesideLoads {
  static constexpr uint32_t kBytes = 0;
  __device__ void issue(int /*stage*/, uint64_t* /*barrier*/, int /*k_block*/) const {}
};

template <GemmKind kKind, class Config>
struct TileLoader {
  __device__ static int num_k_blocks(const GroupedGemmParams& params, const GroupedTile& tile) {
    return ceil_div(kKind == GemmKind::kWgrad ? tile.row_count : params.k, Config::BLOCK_K);
  }

  // wgrad: the k16 steps of k-block k_block that hold rows of the tile's group (all of them but in
  // the group's last block, whose rows past the group's end are zeroed up to the next step).
  __device__ static int k16_steps(const GroupedTile& tile, int k_block) {
    const int steps = ceil_div(tile.row_count - k_block * Config::BLOCK_K, 16);
    return steps < Config::BLOCK_K / 16 ? steps : Config::BLOCK_K / 16;
  }

  // Issues the TMA copies of one k-block into stage `stage`, completing on `barrier`.
  template <class Storage>
  __device__ static void issue_loads(const CUtensorMap* map_a, const CUtensorMap* map_b,
                                     const Storage& smem, int stage, uint64_t* barrier,
                                     const GroupedTile& tile, int k_block) {
    uint8_t* a = smem.a_stage(stage);
    uint8_t* b = smem.b_stage(stage);
    const int k = k_block * Config::BLOCK_K;
    if constexpr (kKind == GemmKind::kWgrad) {
      const int row = tile.row_begin + k;
#pragma unroll
      for (int panel = 0; panel < Config::BLOCK_M / Config::kPanel; ++panel) {
        ptx::tma_load_2d(a + panel * Config::kPanelBytes, map_a, barrier,
                         tile.mblock * Config::BLOCK_M + panel * Config::kPanel, row);
      }
      constexpr int kBPanels = Config::BLOCK_N / Config::kPanel;
      if constexpr (Storage::kClusterSize > 1) {
        // The CTAs of a cluster share the N block (GroupedTileScheduler): each loads its share
        // of B's panels into all of them.
        constexpr int kPanelsPerCta = kBPanels / Storage::kClusterSize;
        static_assert(kPanelsPerCta * Storage::kClusterSize == kBPanels, "whole panels per CTA");
        constexpr uint16_t kAllCtas = (1u << Storage::kClusterSize) - 1;
        const int first_panel = static_cast<int>(ptx::cluster_cta_rank()) * kPanelsPerCta;
#pragma unroll
        for (int i = 0; i < kPanelsPerCta; ++i) {
          const int panel = first_panel + i;
          ptx::tma_load_2d_multicast(b + panel * Config::kPanelBytes, map_b, barrier,
                                     tile.n_block * Config::BLOCK_N + panel * Config::kPanel, row,
                                     kAllCtas);
        }
      } else {
#pragma unroll
        for (int panel = 0; panel < kBPanels; ++panel) {
          ptx::tma_load_2d(b + panel * Config::kPanelBytes, map_b, barrier,
                           tile.n_block * Config::BLOCK_N + panel * Config::kPanel, row);
        }
      }
    } else {
      ptx::tma_load_2d(a, map_a, barrier, k, tile.row_begin + tile.mblock * Config::BLOCK_M);
      if constexpr (kKind == GemmKind::kForward) {
        ptx::tma_load_3d(b, map_b, barrier, k, tile.n_block * Config::BLOCK_N, tile.group);
      } else {
#pragma unroll
        for (int panel = 0; panel < Config::BLOCK_N / Config::kPanel; ++panel) {
          ptx::tma_load_3d(b + panel * Config::kPanelBytes, map_b, barrier,
                           tile.n_block * Config::BLOCK_N + panel * Config::kPanel, k, tile.group);
        }
      }
    }
  }

  // Run by all 32 lanes of the producer warp (lane 0 issues). Returns after the copies of every
  // k-block of `tile` (and `beside`'s) have been issued.
  // NOTE: the rows past a wgrad group's end belong to the next group (TMA only zero-fills past the
  // tensor), so a tail block is staged on the stage's tail barrier, its extra rows zeroed, then
  // published on its full barrier. kTailsApart: another warp does the zeroing and publishing
  // (publish_tails), and this one goes on to the next k-blocks' loads at once; else this warp
  // waits for the tail block itself, and no load is in flight behind it meanwhile. In a cluster
  // the stage's B arrives from every CTA of it, each zeroing its own copy.
  template <bool kTailsApart = false, class Storage, class State, class Beside = NothingBesideLoads>
  __device__ static void load(const CUtensorMap* map_a, const CUtensorMap* map_b,
                              const Storage& smem, const GroupedGemmParams& params,
                              const GroupedTile& tile, State& state, uint32_t& tail_phase,
                              const Beside& beside = {}) {
    static_assert(Beside::kBytes == 0 || kKind == GemmKind::kForward,
                  "loads beside the tile's: forward tiles only (no staged wgrad tail)");
    static_assert(!kTailsApart || Storage::kNumTailBarriers > 1,
                  "tails published apart: one tail barrier per stage");
    const int lane_idx = static_cast<int>(threadIdx.x % 32);
    const int num_blocks = num_k_blocks(params, tile);
    for (int k_block = 0; k_block < num_blocks; ++k_block) {
      ptx::mbarrier_wait(&smem.empty[state.index], state.phase ^ 1u);
      const int valid_rows = tile.row_count - k_block * Config::BLOCK_K;
      if (kKind == GemmKind::kWgrad && valid_rows < Config::BLOCK_K) {
        uint64_t* tail = smem.tail_barrier(state.index);
        if (lane_idx == 0) {
          ptx::mbarrier_arrive_expect_tx(tail, Config::kStageBytes);
          issue_loads(map_a, map_b, smem, state.index, tail, tile, k_block);
        }
        if constexpr (!kTailsApart) {
          publish_tail(smem, state.index, valid_rows, Config::BLOCK_K, tail_phase);
        }
      } else if (lane_idx == 0) {
        uint64_t* full = &smem.full[state.index];
        ptx::mbarrier_arrive_expect_tx(full, Config::kStageBytes + Beside::kBytes);
        issue_loads(map_a, map_b, smem, state.index, full, tile, k_block);
        beside.issue(state.index, full, k_block);
      }
      __syncwarp();
      state.advance();
    }
  }

  // The other warp of load<kTailsApart = true>, all 32 lanes, over the same tiles in the same
  // order: publishes each wgrad tail block that warp staged, in turn, and steps `state` with it.
  // Its consumers issue only the block's k16_steps, so only the rest of the last step is zeroed.
  template <class Storage, class State>
  __device__ static void publish_tails(const Storage& smem, const GroupedGemmParams& params,
                                       const GroupedTile& tile, State& state,
                                       uint32_t& tail_phase) {
    static_assert(kKind == GemmKind::kWgrad, "only wgrad groups have row tails");
    const int num_blocks = num_k_blocks(params, tile);
    for (int k_block = 0; k_block < num_blocks; ++k_block) {
      const int valid_rows = tile.row_count - k_block * Config::BLOCK_K;
      if (valid_rows < Config::BLOCK_K) {
        publish_tail(smem, state.index, valid_rows, 16 * k16_steps(tile, k_block), tail_phase);
      }
      state.advance();
    }
  }

  // Waits for the tail block staged in `stage`, zeroes its rows [valid_rows, end_rows), publishes
  // it.
  template <class Storage>
  __device__ static void publish_tail(const Storage& smem, int stage, int valid_rows, int end_rows,
                                      uint32_t& tail_phase) {
    const int lane_idx = static_cast<int>(threadIdx.x % 32);
    const uint32_t tail_bit = Storage::tail_phase_bit(stage);
    ptx::mbarrier_wait(smem.tail_barrier(stage), (tail_phase & tail_bit) != 0 ? 1u : 0u);
    tail_phase ^= tail_bit;
    zero_tail_rows(smem, stage, valid_rows, end_rows, lane_idx);
    ptx::fence_proxy_async_shared();
    __syncwarp();
    if (lane_idx == 0) ptx::mbarrier_arrive(&smem.full[stage]);
  }

  // Rows [valid_rows, end_rows) of every (64 k, 64 mn) panel of the stage. A swizzled row is one
  // whole 128-byte line, so zeroing lines needs no knowledge of the swizzle.
  template <class Storage>
  __device__ static void zero_tail_rows(const Storage& smem, int stage, int valid_rows,
                                        int end_rows, int lane_idx) {
    constexpr int kLineVectors = 128 / 16;
    constexpr int kNumAPanels = Config::BLOCK_M / Config::kPanel;
    constexpr int kNumPanels = kNumAPanels + Config::BLOCK_N / Config::kPanel;
    const int first_vector = valid_rows * kLineVectors;
    const int end_vector = end_rows * kLineVectors;
#pragma unroll
    for (int panel = 0; panel < kNumPanels; ++panel) {
      uint8_t* base = panel < kNumAPanels
                          ? smem.a_stage(stage) + panel * Config::kPanelBytes
                          : smem.b_stage(stage) + (panel - kNumAPanels) * Config::kPanelBytes;
      // (BLOCK_K rows, 8 vectors of 16 B): row = vector / 8 is one swizzled 128-byte line.
      for (int vector_idx = first_vector + lane_idx; vector_idx < end_vector; vector_idx += 32) {
        reinterpret_cast<uint4*>(base)[vector_idx] = make_uint4(0, 0, 0, 0);
      }
    }
  }
};

}  // namespace mok::gemm
