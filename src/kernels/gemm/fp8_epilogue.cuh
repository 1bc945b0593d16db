// The FP8 GEMM's epilogues: a consumer warpgroup's promoted (64, BLOCK_N) fp32 accumulators,
// walked as wgmma's fragment (fragment.cuh), stored as fp32 pairs from registers, or as bf16 (or
// SwiGLU's h) through the warp's staging rows (warp_rows.cuh), as the bf16 engine stores them.
// The wgrad's C is (groups, M, N); its accumulating epilogue starts the accumulators from C.
#pragma once

#include "kernels/gemm/fp8_gemm_types.cuh"
#include "kernels/gemm/fragment.cuh"
#include "kernels/gemm/swiglu.cuh"
#include "kernels/gemm/tile_scheduler.cuh"
#include "kernels/gemm/warp_rows.cuh"

namespace mok::gemm {

template <EpilogueKind kEpilogue, GemmKind kKind = GemmKind::kForward>
struct Fp8Epilogue {
  using Config = Fp8TileConfig;
  static constexpr int kNumAccumulators = Config::BLOCK_N / 2;
  static_assert(kEpilogue != EpilogueKind::kAccumulateFp32 || kKind == GemmKind::kWgrad,
                "only the wgrad accumulates into its output (main_grad)");
  static_assert(kEpilogue != EpilogueKind::kSwiGluBf16 || kKind == GemmKind::kForward,
                "SwiGLU belongs to the forward");

  // The accumulators a tile starts from: zero, or (kAccumulateFp32) the consumer's slice of C.
  __device__ static void init(const GroupedGemmParams& params, const GroupedTile& tile,
                              int consumer_idx, float (&accum)[kNumAccumulators]) {
#pragma unroll
    for (int i = 0; i < kNumAccumulators; ++i) accum[i] = 0.0f;
    if constexpr (kEpilogue == EpilogueKind::kAccumulateFp32) {
      const int warp_in_group = static_cast<int>(threadIdx.x / 32) % 4;
      const int lane_idx = static_cast<int>(threadIdx.x % 32);
      const TileInC place = tile_in_c<kKind, kEpilogue, Config>(params, tile);
      load_fp32_fragment<Config::BLOCK_N>(
          place, consumer_idx * 64 + warp_in_group * 16 + lane_idx / 4, 2 * (lane_idx % 4), accum);
    }
  }

  // A consumer covers rows 64 c .. 64 c + 63 and all columns of a full tile, rows 0-63 and
  // columns 128 c .. 128 c + 127 (piece c) of a half tile (is_half_tile). Rows past the group's end
  // and columns past N are never written.
  __device__ static void store(const GroupedGemmParams& params, const GroupedTile& tile,
                               int consumer_idx, uint8_t* staging,
                               float (&accum)[kNumAccumulators]) {
    const int warp_in_group = static_cast<int>(threadIdx.x / 32) % 4;
    const int lane_idx = static_cast<int>(threadIdx.x % 32);
    const bool half = is_half_tile<kKind>(tile);
    const TileInC place = tile_in_c<kKind, kEpilogue, Config>(params, tile);
    const int warp_first_row = (half ? 0 : consumer_idx * 64) + warp_in_group * 16;
    const int first_column = half ? consumer_idx * Config::kPiece : 0;
    uint8_t* warp_staging =
        staging + (consumer_idx * 64 + warp_in_group * 16) * static_cast<int>(kStagingRowBytes);
    if (half) {
      store_columns<Config::kPiece>(place, warp_first_row, first_column, lane_idx, warp_staging,
                                    accum);
    } else {
      store_columns<Config::BLOCK_N>(place, warp_first_row, first_column, lane_idx, warp_staging,
                                     accum);
    }
  }

 private:
  static constexpr bool kSwiGlu = kEpilogue == EpilogueKind::kSwiGluBf16;

  // The consumer's kColumns columns from first_column on: its accum[0, kColumns / 2).
  template <int kColumns>
  __device__ static void store_columns(const TileInC& place, int warp_first_row, int first_column,
                                       int lane_idx, uint8_t* warp_staging,
                                       float (&accum)[kNumAccumulators]) {
    if constexpr (!uses_staged_store(kEpilogue)) {
      store_fp32_fragment<kColumns>(place, warp_first_row + lane_idx / 4,
                                    first_column + 2 * (lane_idx % 4), accum);
    } else {
      using Rows = WarpRows<kColumns, kSwiGlu>;
      if constexpr (kSwiGlu) swiglu_in_place<kColumns / 2>(accum);
      uint32_t packed[Rows::kPacked];
      Rows::pack(accum, packed);
      const int first_out_column = kSwiGlu ? first_column / 2 : first_column;
      Rows::write(warp_staging, packed, place.columns_valid - first_out_column,
                  [&](int warp_row) -> char* {
                    const int row = warp_first_row + warp_row;
                    if (row >= place.rows_valid) return nullptr;
                    return place.tile_base + row * place.row_stride + first_out_column * 2;
                  });
    }
  }
};

}  // namespace mok::gemm
