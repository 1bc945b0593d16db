// Epilogues: what a consumer warpgroup does with its (64, BLOCK_N) fp32 accumulators, walked as
// wgmma's fragment (fragment.cuh): every store is a pair of adjacent columns, and the SwiGLU pairs
// (gate block j, up block j + 1 of the 8-interleaved fused weight) sit in the same thread.
#pragma once

#include <cuda_bf16.h>

#include "kernels/gemm/fragment.cuh"
#include "kernels/gemm/gemm_types.cuh"
#include "kernels/gemm/swiglu.cuh"
#include "kernels/schedule/tile_scheduler.cuh"

namespace mok::gemm {

template <GemmKind kKind, EpilogueKind kEpilogue>
struct Epilogue {
  using Config = TileConfig;
  static constexpr int kNumAccumulators = Config::BLOCK_N / 2;

  // Where this thread's fragment lands: the tile's place in C, and tile rows (row, row + 8) and
  // the column base of block j = 0. A consumer covers rows 64 c .. 64 c + 63 and all columns of
  // a full tile, rows 0-63 and columns 128 c .. 128 c + 127 of a half tile (is_half_tile).
  struct Fragment : TileInC {
    int row;            // in the C tile, first of the pair row / row + 8
    int column;         // in the consumer's columns, of block j = 0
    int first_column;   // the consumer's first column in the C tile (before SwiGLU halving)
    int staging_row;    // first of the warp's 16 staging rows (its own in either kind of tile)
  };

  // Where row `tile_row` of a staged tile goes: row-major C, rows tile_base + row * row_stride.
  // A caller may pass another destination per row (the fused forward's combine, which sends each
  // row to its token's owner).
  struct RowMajorRows {
    __device__ char* operator()(const Fragment& f, const GroupedTile&, int tile_row) const {
      return f.tile_base + tile_row * f.row_stride;
    }
  };

  __device__ static Fragment fragment(const GroupedGemmParams& params, const GroupedTile& tile,
                                      int consumer_idx) {
    const int warp_in_group = static_cast<int>(threadIdx.x / 32) % 4;
    const int lane_idx = static_cast<int>(threadIdx.x % 32);
    const bool half = is_half_tile<kKind>(tile);
    Fragment fragment;
    static_cast<TileInC&>(fragment) = tile_in_c<kKind, kEpilogue, Config>(params, tile);
    fragment.row = (half ? 0 : consumer_idx * 64) + warp_in_group * 16 + lane_idx / 4;
    fragment.column = 2 * (lane_idx % 4);
    fragment.first_column = half ? consumer_idx * (Config::BLOCK_N / 2) : 0;
    fragment.staging_row = consumer_idx * 64 + warp_in_group * 16;
    return fragment;
  }

  // Accumulator start values: zero, or the fp32 main_grad this tile accumulates into.
  __device__ static void init(const GroupedGemmParams& params, const GroupedTile& tile,
                              int consumer_idx, float (&accum)[kNumAccumulators]) {
#pragma unroll
    for (int i = 0; i < kNumAccumulators; ++i) accum[i] = 0.0f;
    if constexpr (kEpilogue == EpilogueKind::kAccumulateFp32) {
      static_assert(kKind == GemmKind::kWgrad, "main_grad accumulation is wgrad's (no half tiles)");
      const Fragment f = fragment(params, tile, consumer_idx);
      load_fp32_fragment<Config::BLOCK_N>(f, f.row, f.column, accum);
    }
  }

  // The tile's results: fp32 from registers, or bf16 through the staging tile. Each warp stages
  // its 16 rows, 128 columns at a time, in its own staging rows, then copies them out with 16-byte
  // loads and stores, whole rows side by side (coalesced). Rows past the group's end or past M are
  // never written. The stores are ordinary (generic proxy) global stores.
  template <class RowDestination = RowMajorRows>
  __device__ static void store(const GroupedGemmParams& params, const GroupedTile& tile,
                               int consumer_idx, uint8_t* staging,
                               float (&accum)[kNumAccumulators],
                               const RowDestination& row_destination = {}) {
    const Fragment f = fragment(params, tile, consumer_idx);
    if (is_half_tile<kKind>(tile)) {
      store_columns<Config::BLOCK_N / 2>(f, tile, staging, accum, row_destination);
    } else {
      store_columns<Config::BLOCK_N>(f, tile, staging, accum, row_destination);
    }
  }

 private:
  using Layout = SharedLayout<kEpilogue>;
  static constexpr bool kSwiGlu = kEpilogue == EpilogueKind::kSwiGluBf16;
  static constexpr int kPassChunks = Layout::kStagingRowBytes / 16;  // 16-byte chunks of a pass

  // store() for a consumer's kColumns columns: its accum[0, kColumns / 2).
  template <int kColumns, class RowDestination>
  __device__ static void store_columns(const Fragment& f, const GroupedTile& tile,
                                       uint8_t* staging, float (&accum)[kNumAccumulators],
                                       const RowDestination& row_destination) {
    if constexpr (!uses_staged_store(kEpilogue)) {
      store_fp32_fragment<kColumns>(f, f.row, f.first_column + f.column, accum);
    } else {
      if constexpr (kSwiGlu) swiglu_in_place<kColumns / 2>(accum);
      // The output pairs rounded to bf16 first: a second staging pass then keeps half as many
      // registers live as the fp32 values would.
      uint32_t packed[kColumns / 4];
      pack_outputs<kColumns>(accum, packed);
      constexpr int kOutChunks = (kSwiGlu ? kColumns / 2 : kColumns) / 8;  // bf16 x 8 each
      constexpr int kPasses = (kOutChunks + kPassChunks - 1) / kPassChunks;
      static_assert(kOutChunks < kPassChunks || kOutChunks % kPassChunks == 0, "whole passes");
      constexpr int kChunks = kOutChunks < kPassChunks ? kOutChunks : kPassChunks;  // a pass's
      static_assert(32 % kChunks == 0, "a warp copies whole rows at a time");
      constexpr int kRowsAtOnce = 32 / kChunks;
      const int lane_idx = static_cast<int>(threadIdx.x % 32);
      const int warp_first_row = f.row - lane_idx / 4;  // tile row of the warp's row 0
      char* row_start = nullptr;
      // The consumer's first bf16 output column, in the C tile.
      const int first_out_column = kSwiGlu ? f.first_column / 2 : f.first_column;
      uint8_t* warp_staging = staging + f.staging_row * Layout::kStagingRowBytes;
#pragma unroll
      for (int pass = 0; pass < kPasses; ++pass) {
        __syncwarp();  // the previous pass's rows have been read
        stage_pass<kColumns>(warp_staging, pass, lane_idx, packed);
        if (pass == 0 && lane_idx < 16 && warp_first_row + lane_idx < f.rows_valid) {
          // NOTE: once the first pass is staged, so that fewer output registers are live (the
          // destination may need registers of its own: the fused combine's looks up each row's
          // owner). Lane i < 16 holds where the warp's row i goes; null past the valid rows.
          row_start = row_destination(f, tile, warp_first_row + lane_idx);
        }
        __syncwarp();
        const int chunk = lane_idx % kChunks;
        const int column = first_out_column + 8 * (pass * kPassChunks + chunk);
#pragma unroll 1
        for (int first = 0; first < 16; first += kRowsAtOnce) {
          const int row = first + lane_idx / kChunks;
          const uint4 value = *reinterpret_cast<const uint4*>(
              warp_staging + row * Layout::kStagingRowBytes + staged_chunk_offset(row, chunk));
          char* destination = reinterpret_cast<char*>(
              __shfl_sync(0xffffffffu, reinterpret_cast<uintptr_t>(row_start), row));
          if (destination != nullptr && column < f.columns_valid) {
            *reinterpret_cast<uint4*>(destination + column * 2) = value;
          }
        }
      }
    }
  }

  // Where 16-byte chunk `chunk` of staged row `row` lies in the row: the chunks of the warp's 8
  // fragment rows are XOR-swizzled, so that a fragment store (8 rows, one chunk each) hits every
  // bank once.
  __device__ static uint32_t staged_chunk_offset(int row, int chunk) {
    return static_cast<uint32_t>((chunk ^ (row % 8)) * 16);
  }

  // The bf16 output pairs of accum[0, kColumns / 2) in fragment order: packed[2 o + half] is
  // output chunk o (8 columns) of fragment row lane / 4 + 8 half. Plain outputs: pair (4 j + 2 half,
  // + 1) of fragment block j; SwiGLU: the gate pair of gate block 2 o (swiglu_in_place's h).
  template <int kColumns>
  __device__ static void pack_outputs(const float (&accum)[kNumAccumulators],
                                      uint32_t (&packed)[kColumns / 4]) {
#pragma unroll
    for (int j = 0; j < kColumns / 8; j += kSwiGlu ? 2 : 1) {
      const int out_chunk = kSwiGlu ? j / 2 : j;
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int index = 4 * j + 2 * half;
        const __nv_bfloat162 pair = __floats2bfloat162_rn(accum[index], accum[index + 1]);
        packed[2 * out_chunk + half] = *reinterpret_cast<const uint32_t*>(&pair);
      }
    }
  }

  // Writes the pairs of pass `pass` (bf16 output chunks [pass, pass + 1) * kPassChunks) into the
  // warp's staging rows.
  template <int kColumns>
  __device__ static void stage_pass(uint8_t* warp_staging, int pass, int lane_idx,
                                    const uint32_t (&packed)[kColumns / 4]) {
    constexpr int kOutChunks = (kSwiGlu ? kColumns / 2 : kColumns) / 8;
    const int quad_byte = 4 * (lane_idx % 4);
#pragma unroll
    for (int out_chunk = 0; out_chunk < kOutChunks; ++out_chunk) {
      if (out_chunk / kPassChunks != pass) continue;
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int row = lane_idx / 4 + 8 * half;
        *reinterpret_cast<uint32_t*>(warp_staging + row * Layout::kStagingRowBytes +
                                     staged_chunk_offset(row, out_chunk % kPassChunks) +
                                     quad_byte) = packed[2 * out_chunk + half];
      }
    }
  }
};

}  // namespace mok::gemm
