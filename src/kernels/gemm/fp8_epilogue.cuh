// The FP8 GEMM's epilogues: a consumer warpgroup's promoted (64, BLOCK_N) fp32 accumulators,
// walked as wgmma's fragment (fragment.cuh), stored as fp32 pairs from registers, or as bf16 (or
// SwiGLU's h) through the warp's staging rows (warp_rows.cuh), as the bf16 engine stores them, or
// (kSwiGluFp8) as SwiGLU's h quantized to E4M3 per 1 x 128 with its scales. The wgrad's bf16
// gradients are staged as a whole tile, which a store warp copies out by TMA (tile_boxes.cuh).
// The wgrad's C is (groups, M, N); its accumulating epilogue starts the accumulators from C.
#pragma once

#include "kernels/gemm/fp8_gemm_types.cuh"
#include "kernels/gemm/fp8_tile_scheduler.cuh"
#include "kernels/gemm/fragment.cuh"
#include "kernels/gemm/swiglu.cuh"
#include "kernels/gemm/tile_boxes.cuh"
#include "kernels/gemm/tile_scheduler.cuh"
#include "kernels/gemm/warp_rows.cuh"
#include "kernels/quantize/elements.cuh"

namespace mok::gemm {

// kGateUp (kSwiGluFp8 only): the gate/up sums go out in bf16 too (Fp8GemmParams::gate_up), in an
// instance of its own, so that the inference kernel's registers stay as they are.
template <EpilogueKind kEpilogue, GemmKind kKind = GemmKind::kForward, bool kGateUp = false>
struct Fp8Epilogue {
  using Config = Fp8TileConfig;
  static constexpr int kNumAccumulators = Config::BLOCK_N / 2;
  static_assert(kEpilogue != EpilogueKind::kAccumulateFp32 || kKind == GemmKind::kWgrad,
                "only the wgrad accumulates into its output (main_grad)");
  static_assert((kEpilogue != EpilogueKind::kSwiGluBf16 && kEpilogue != EpilogueKind::kSwiGluFp8) ||
                    kKind == GemmKind::kForward,
                "SwiGLU belongs to the forward");
  static_assert(!kGateUp || kEpilogue == EpilogueKind::kSwiGluFp8,
                "the gate/up sums beside h are kSwiGluFp8's");

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

  // wgrad's bf16 weight gradients go out by TMA tile stores from a whole staged tile, issued by a
  // store warp (tile_boxes.cuh: stage_tile, store_tile); every other output by warp stores.
  static constexpr bool kBoxStores =
      kKind == GemmKind::kWgrad && kEpilogue == EpilogueKind::kStoreBf16;
  using Boxes = TileBoxes<Config::BLOCK_M, Config::BLOCK_N>;

  // kBoxStores, a consumer warp: its rows of the tile into the staging (after Boxes::wait_free),
  // published to the store warp. No branch (the next tile's first wgmma group may be in flight).
  __device__ static void stage_tile(int consumer_idx, const typename Boxes::Staging& staging,
                                    const float (&accum)[kNumAccumulators]) {
    static_assert(kBoxStores, "the wgrad's bf16 gradients");
    const int warp_in_group = static_cast<int>(threadIdx.x / 32) % 4;
    Boxes::stage(staging, accum, consumer_idx * 64 + warp_in_group * 16);
  }

  // kBoxStores, the store warp: its `stored`-th tile, once staged, to C (map_c: C as a [groups,
  // M, N] tensor map with the boxes' (BLOCK_M, 64) shape).
  __device__ static void store_tile(const GroupedTile& tile, const typename Boxes::Staging& staging,
                                    uint32_t stored, const CUtensorMap* map_c) {
    static_assert(kBoxStores, "the wgrad's bf16 gradients");
    Boxes::store(staging, stored, map_c, tile.n_block * Config::BLOCK_N,
                 tile.mblock * Config::BLOCK_M, tile.group);
  }

  // A consumer covers rows 64 c .. 64 c + 63 and all columns of a full tile, rows 0-63 and
  // columns 128 c .. 128 c + 127 (piece c) of a half tile (is_half_tile). Rows past the group's end
  // and columns past N are never written. gate_up, gate_up_rows (kGateUp): where the gate/up sums
  // go in bf16 (Fp8GemmParams::gate_up, gate_up_rows). (kBoxStores: stage_tile instead.)
  __device__ static void store(const GroupedGemmParams& params, const GroupedTile& tile,
                               int consumer_idx, uint8_t* staging, float (&accum)[kNumAccumulators],
                               void* gate_up = nullptr, const int32_t* gate_up_rows = nullptr) {
    static_assert(!kBoxStores, "the wgrad's bf16 gradients leave by stage_tile");
    const int warp_in_group = static_cast<int>(threadIdx.x / 32) % 4;
    const int lane_idx = static_cast<int>(threadIdx.x % 32);
    if constexpr (kEpilogue == EpilogueKind::kSwiGluFp8) {
      store_swiglu_fp8(params, tile, consumer_idx, staging, accum, gate_up, gate_up_rows);
      return;
    }
    const bool half = fp8_is_half_tile<kKind, kEpilogue>(tile);
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

  // kSwiGluFp8 (always a whole tile, fp8_is_half_tile): gate columns in accum[0, 64), up in
  // accum[64, 128) (128-interleaved), so the tile's 128 h columns are one 1 x 128 block of each
  // row. A row's 32 values per lane lie in the 4 lanes of a quad, whose amax two shuffles join;
  // the E4M3 pairs go through the warp's staging rows (128 bytes of each) and leave as 16-byte
  // stores of whole rows. Rows past the group's end are not written.
  __device__ static void store_swiglu_fp8(const GroupedGemmParams& params, const GroupedTile& tile,
                                          int consumer_idx, uint8_t* staging,
                                          float (&accum)[kNumAccumulators], void* gate_up,
                                          const int32_t* gate_up_rows) {
    constexpr int kHalf = kNumAccumulators / 2;     // gate accumulators: 32 per fragment row
    constexpr int kRowBytes = Config::BLOCK_N / 2;  // h columns of the tile, one byte each
    const int warp_in_group = static_cast<int>(threadIdx.x / 32) % 4;
    const int lane_idx = static_cast<int>(threadIdx.x % 32);
    const TileInC place = tile_in_c<kKind, kEpilogue, Config>(params, tile);
    const int warp_first_row = consumer_idx * 64 + warp_in_group * 16;  // in the tile
    uint8_t* warp_staging = staging + warp_first_row * static_cast<int>(kStagingRowBytes);
    const int64_t tile_first_row =
        tile.row_begin + static_cast<int64_t>(tile.mblock) * Config::BLOCK_M;
    const int scales_per_row = params.n / Config::BLOCK_N;
    if constexpr (kGateUp) {
      store_gate_up(static_cast<char*>(gate_up) + tile.n_block * Config::BLOCK_N * 2,
                    int64_t{params.n} * 2, gate_up_rows, tile_first_row, place.rows_valid,
                    warp_first_row, warp_staging, accum);
    }
    swiglu_halves_in_place<kHalf>(accum);
    __syncwarp();  // the previous tile's rows have left the staging rows
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      float values[kHalf / 2];  // this lane's 32 values of row lane / 4 + 8 half
#pragma unroll
      for (int j = 0; j < kHalf / 4; ++j) {
        values[2 * j] = accum[4 * j + 2 * half];
        values[2 * j + 1] = accum[4 * j + 2 * half + 1];
      }
      const float amax =
          __uint_as_float(quantize::lanes_max<4>(quantize::finite_amax_bits(values)));
      const fp8::Fp8BlockScale scale = fp8::fp8_block_scale(amax);
      uint32_t words[kHalf / 8];
      quantize::encode_scaled(values, scale.inverse, words);
      const int row = lane_idx / 4 + 8 * half;  // in the warp
      uint8_t* staged_row = warp_staging + row * static_cast<int>(kStagingRowBytes);
#pragma unroll
      for (int j = 0; j < kHalf / 4; ++j) {  // fragment block j: columns 8 j + 2 (lane % 4), + 1
        *reinterpret_cast<uint16_t*>(staged_row + 8 * j + 2 * (lane_idx % 4)) =
            static_cast<uint16_t>(words[j / 2] >> (16 * (j % 2)));
      }
      if (lane_idx % 4 == 0 && warp_first_row + row < place.rows_valid) {
        params.output_scales[(tile_first_row + warp_first_row + row) * scales_per_row +
                             tile.n_block] = scale.scale;
      }
    }
    __syncwarp();
    constexpr int kVectorsPerRow = kRowBytes / 16;
#pragma unroll
    for (int vector = lane_idx; vector < 16 * kVectorsPerRow; vector += 32) {
      const int row = vector / kVectorsPerRow, chunk = vector % kVectorsPerRow;
      if (warp_first_row + row < place.rows_valid) {
        *reinterpret_cast<uint4*>(place.tile_base + (warp_first_row + row) * place.row_stride +
                                  16 * chunk) =
            *reinterpret_cast<const uint4*>(warp_staging +
                                            row * static_cast<int>(kStagingRowBytes) + 16 * chunk);
      }
    }
  }

  // kSwiGluFp8's gate/up sums (gate_up): the consumer's 256 columns rounded to bf16, the gate
  // piece then the up piece, through the warp's staging rows as kStoreBf16 writes them (so the
  // same bytes), 128 columns at a time, so that one piece's pairs are live beside the accumulators
  // the SwiGLU still needs. columns_base: the tile's first column in gate_up's row 0; GEMM row r
  // goes to row rows[r] (not stored when < 0), or r when rows is null; the tile's rows from
  // rows_valid on are not stored.
  __device__ static void store_gate_up(char* columns_base, int64_t row_stride, const int32_t* rows,
                                       int64_t tile_first_row, int rows_valid, int warp_first_row,
                                       uint8_t* warp_staging,
                                       const float (&accum)[kNumAccumulators]) {
    using Rows = WarpRows<Config::kPiece, /*kSwiGlu=*/false>;
    constexpr int kPieceAccumulators = kNumAccumulators / Config::kNumPieces;
#pragma unroll
    for (int piece = 0; piece < Config::kNumPieces; ++piece) {
      uint32_t packed[Rows::kPacked];
      Rows::pack(
          *reinterpret_cast<const float(*)[kPieceAccumulators]>(&accum[piece * kPieceAccumulators]),
          packed);
      const int first_column = piece * Config::kPiece;
      Rows::write(warp_staging, packed, Config::kPiece, [&](int warp_row) -> char* {
        const int row = warp_first_row + warp_row;
        if (row >= rows_valid) return nullptr;
        const int64_t gemm_row = tile_first_row + row;
        const int64_t destination = rows != nullptr ? rows[gemm_row] : gemm_row;
        if (destination < 0) return nullptr;
        return columns_base + destination * row_stride + first_column * 2;
      });
    }
  }

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
