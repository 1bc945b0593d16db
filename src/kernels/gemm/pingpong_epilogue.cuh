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
#include "kernels/gemm/tile_scheduler.cuh"
#include "kernels/gemm/warp_rows.cuh"

namespace mok::gemm {

template <GemmKind kKind, EpilogueKind kEpilogue, int kBlockM>
struct PingpongEpilogue {
  using Config = PingpongConfig<kBlockM>;
  static constexpr int kNumRowBlocks = Config::BLOCK_M / 64;
  static constexpr int kRowBlockAccumulators = Config::BLOCK_N / 2;  // per thread
  static constexpr bool kSwiGlu = kEpilogue == EpilogueKind::kSwiGluBf16;
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

  // bf16 results: each warp writes its 16 rows of one row block after the other through its own
  // staging rows (warp_rows.cuh). Rows past the group's end or past M are never written.
  __device__ static void store(const GroupedGemmParams& params, const GroupedTile& tile,
                               uint8_t* staging, Accumulators& accum) {
    const Fragment f = fragment(params, tile);
    if constexpr (!uses_staged_store(kEpilogue)) {
#pragma unroll
      for (int r = 0; r < kNumRowBlocks; ++r) {
        store_fp32_fragment<Config::BLOCK_N>(f, 64 * r + f.row, f.column, accum[r]);
      }
    } else {
      using Rows = WarpRows<Config::BLOCK_N, kSwiGlu>;
      const int warp_in_group = static_cast<int>(threadIdx.x / 32) % 4;
      const int warp_first_row = f.row - static_cast<int>(threadIdx.x % 32) / 4;
      uint8_t* warp_staging = staging + warp_in_group * kWarpStagingBytes;
#pragma unroll
      for (int r = 0; r < kNumRowBlocks; ++r) {
        if constexpr (kSwiGlu) swiglu_in_place<Config::BLOCK_N / 2>(accum[r]);
        uint32_t packed[Rows::kPacked];
        Rows::pack(accum[r], packed);
        Rows::write(warp_staging, packed, f.columns_valid, [&](int warp_row) -> char* {
          const int row = 64 * r + warp_first_row + warp_row;
          return row < f.rows_valid
                     ? tile_row_in_c<Config>(f, tile, row, params.output_rows, params.output)
                     : nullptr;
        });
      }
    }
  }
};

}  // namespace mok::gemm
