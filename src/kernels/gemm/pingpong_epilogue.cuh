// The ping-pong engine's epilogues: what a consumer warpgroup does with its (BLOCK_M, BLOCK_N)
// tile of fp32 accumulators, row block r (rows 64r .. 64r + 63) in accum[r].
//
// Each row block is one wgmma fragment (fragment.cuh), rows shifted by 64r: a warp owns rows
// {16w .. 16w + 15} of each row block, and the SwiGLU pairs (gate block j, up block j + 1 of the
// 8-interleaved fused weight) sit in the same thread.
// Arithmetic and rounding are the cooperative engine's (epilogue.cuh) element for element.
#pragma once

#include <cuda_bf16.h>

#include "kernels/gemm/fragment.cuh"
#include "kernels/gemm/gemm_types.cuh"
#include "kernels/gemm/pingpong_types.cuh"
#include "kernels/gemm/swiglu.cuh"
#include "kernels/ptx/barrier.cuh"
#include "kernels/ptx/tma.cuh"
#include "kernels/schedule/tile_scheduler.cuh"

namespace mok::gemm {

template <GemmKind kKind, EpilogueKind kEpilogue, int kBlockM>
struct PingpongEpilogue {
  using Config = PingpongConfig<kBlockM>;
  using Layout = PingpongSharedLayout<kEpilogue, kBlockM>;
  static constexpr int kNumRowBlocks = Config::BLOCK_M / 64;
  static constexpr int kRowBlockAccumulators = Config::BLOCK_N / 2;  // per thread
  static constexpr bool kSwiGlu = kEpilogue == EpilogueKind::kSwiGluBf16;
  static constexpr int kTileColumns = output_tile_columns<Config>(kEpilogue);
  using Accumulators = float[kNumRowBlocks][kRowBlockAccumulators];

  // Where this thread's fragment lands: the tile's place in C, and tile rows (row, row + 8) of
  // row block 0 and the column of j = 0.
  struct Fragment : TileInC {
    int row;
    int column;
  };

  __device__ static Fragment fragment(const GroupedGemmParams& params, const GroupedTile& tile) {
    const int warp_in_group = static_cast<int>(threadIdx.x / 32) % 4;
    const int lane_idx = static_cast<int>(threadIdx.x % 32);
    Fragment fragment;
    static_cast<TileInC&>(fragment) = tile_in_c<kKind, kEpilogue, Config>(params, tile);
    fragment.row = warp_in_group * 16 + lane_idx / 4;
    fragment.column = 2 * (lane_idx % 4);
    return fragment;
  }

  // Accumulator start values: zero, or the fp32 main_grad this tile accumulates into.
  __device__ static void init(const GroupedGemmParams& params, const GroupedTile& tile,
                              Accumulators& accum) {
#pragma unroll
    for (int r = 0; r < kNumRowBlocks; ++r) {
#pragma unroll
      for (int i = 0; i < kRowBlockAccumulators; ++i) accum[r][i] = 0.0f;
    }
    if constexpr (kEpilogue == EpilogueKind::kAccumulateFp32) {
      const Fragment f = fragment(params, tile);
#pragma unroll
      for (int r = 0; r < kNumRowBlocks; ++r) {
        load_fp32_fragment<Config::BLOCK_N>(f, 64 * r + f.row, f.column, accum[r]);
      }
    }
  }

  // bf16 results: the warp writes its 16 rows of each row block into this consumer's staging
  // tile, then one lane per row copies it to global memory with a bulk copy. Rows past the
  // group's end or past M are never copied, and the copies drain while the other consumer runs
  // its mainloop.
  __device__ static void store(const GroupedGemmParams& params, const GroupedTile& tile,
                               uint8_t* staging, Accumulators& accum) {
    const Fragment f = fragment(params, tile);
    if constexpr (!uses_staged_store(kEpilogue)) {
#pragma unroll
      for (int r = 0; r < kNumRowBlocks; ++r) {
        store_fp32_fragment<Config::BLOCK_N>(f, 64 * r + f.row, f.column, accum[r]);
      }
    } else {
      constexpr uint32_t kPitch = Layout::kStagingPitch;
      const int lane_idx = static_cast<int>(threadIdx.x % 32);
      const int warp_first_row = f.row - lane_idx / 4;  // the warp's 16 rows of each row block
      // The previous tile's copies must have finished reading these staging rows.
      ptx::bulk_wait_group_read<0>();
      __syncwarp();
#pragma unroll
      for (int r = 0; r < kNumRowBlocks; ++r) {
        uint8_t* warp_staging = staging + (64 * r + warp_first_row) * kPitch;
        if constexpr (kSwiGlu) {
          swiglu_in_place<Config::BLOCK_N / 2>(accum[r]);
#pragma unroll
          for (int j = 0; j < Config::BLOCK_N / 8; j += 2) {
#pragma unroll
            for (int half = 0; half < 2; ++half) {
              const int gate = 4 * j + 2 * half;
              stage_pair(warp_staging, lane_idx / 4 + 8 * half, f.column + 4 * j, accum[r][gate],
                         accum[r][gate + 1]);
            }
          }
        } else {
          for_each_fragment_pair<Config::BLOCK_N>(
              lane_idx / 4, f.column, [&](int row, int column, int index) {
                stage_pair(warp_staging, row, column, accum[r][index], accum[r][index + 1]);
              });
        }
      }
      // NOTE: the bulk copy engine reads through the async proxy.
      ptx::fence_proxy_async_shared();
      __syncwarp();
      // Lane l copies row l % 16 of the warp's 16 rows in row block l / 16.
      const int row = 64 * (lane_idx / 16) + warp_first_row + lane_idx % 16;
      const int columns = min(f.columns_valid, kTileColumns);
      if (lane_idx / 16 < kNumRowBlocks && row < f.rows_valid && columns > 0) {
        ptx::bulk_store(f.tile_base + row * f.row_stride, staging + row * kPitch,
                        static_cast<uint32_t>(columns) * 2);
      }
      ptx::bulk_commit_group();
    }
  }

  // Before the CTA exits: every bulk copy this thread issued has landed.
  __device__ static void drain() {
    if constexpr (uses_staged_store(kEpilogue)) ptx::bulk_wait_group<0>();
  }

 private:
  __device__ static void stage_pair(uint8_t* warp_staging, int row, int column, float x,
                                    float y) {
    *reinterpret_cast<__nv_bfloat162*>(warp_staging + row * Layout::kStagingPitch + column * 2) =
        __floats2bfloat162_rn(x, y);
  }
};

}  // namespace mok::gemm
