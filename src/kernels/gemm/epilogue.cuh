// Epilogues: what a consumer warpgroup does with its (64, BLOCK_N) fp32 accumulators, walked as
// wgmma's fragment (fragment.cuh): every store is a pair of adjacent columns, and the SwiGLU pairs
// (gate block j, up block j + 1 of the 8-interleaved fused weight) sit in the same thread.
#pragma once

#include <cuda_bf16.h>

#include "kernels/gemm/fragment.cuh"
#include "kernels/gemm/gemm_types.cuh"
#include "kernels/gemm/swiglu.cuh"
#include "kernels/gemm/tile_scheduler.cuh"
#include "kernels/gemm/warp_boxes.cuh"
#include "kernels/gemm/warp_rows.cuh"

namespace mok::gemm {

template <GemmKind kKind, EpilogueKind kEpilogue>
struct Epilogue {
  using Config = TileConfig;
  static constexpr int kNumAccumulators = Config::BLOCK_N / 2;

  // Where this thread's fragment lands: the tile's place in C, and tile rows (row, row + 8) and
  // the column base of block j = 0. A consumer covers rows 64 c .. 64 c + 63 and all columns of
  // a full tile, rows 0-63 and columns 128 c .. 128 c + 127 of a half tile (is_half_tile).
  struct Fragment : TileInC {
    int row;           // in the C tile, first of the pair row / row + 8
    int column;        // in the consumer's columns, of block j = 0
    int first_column;  // the consumer's first column in the C tile (before SwiGLU halving)
    int staging_row;   // first of the warp's 16 staging rows (its own in either kind of tile)
  };

  // Where row `tile_row` of a staged tile goes: row-major C, rows tile_base + row * row_stride,
  // or, with the params' output_rows, row output_rows[r] of C for the call's row r. A caller may
  // pass another destination per row (the fused forward's combine, which sends each row to its
  // token's owner).
  struct RowMajorRows {
    const int32_t* output_rows = nullptr;  // GroupedGemmParams::output_rows
    char* output = nullptr;                // C, with output_rows

    __device__ static RowMajorRows of(const GroupedGemmParams& params) {
      return {params.output_rows, static_cast<char*>(params.output)};
    }
    __device__ char* operator()(const Fragment& f, const GroupedTile& tile, int tile_row) const {
      // (wgrad's C rows are the weights': the host refuses output_rows there)
      if constexpr (kKind == GemmKind::kWgrad) return f.tile_base + tile_row * f.row_stride;
      return tile_row_in_c<Config>(f, tile, tile_row, output_rows, output);
    }
    // The same for the tile of the row block `blocks` on (its Fragment and tile place it).
    __device__ RowMajorRows block(int /*blocks*/) const { return *this; }
  };

  // The first of this warp's 16 staging rows.
  __device__ static int warp_staging_row(int consumer_idx) {
    return consumer_idx * 64 + static_cast<int>(threadIdx.x / 32) % 4 * 16;
  }

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
    fragment.staging_row = warp_staging_row(consumer_idx);
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

  // wgrad's bf16 weight gradients go out by TMA tile stores (warp_boxes.cuh, store_holding);
  // every other output by warp stores.
  static constexpr bool kBoxStores =
      kKind == GemmKind::kWgrad && kEpilogue == EpilogueKind::kStoreBf16;

  // The tile's results: fp32 from registers, or bf16 through the warps' staging rows
  // (warp_rows.cuh). Rows past the group's end or past M are never written. (The wgrad's bf16
  // tiles, kBoxStores, leave by store_holding instead.)
  template <class RowDestination = RowMajorRows>
  __device__ static void store(const GroupedGemmParams& params, const GroupedTile& tile,
                               int consumer_idx, uint8_t* staging, float (&accum)[kNumAccumulators],
                               const RowDestination& row_destination = {}) {
    const Fragment f = fragment(params, tile, consumer_idx);
    if (is_half_tile<kKind>(tile)) {
      store_columns<Config::BLOCK_N / 2>(f, tile, staging, accum, row_destination);
    } else {
      store_columns<Config::BLOCK_N>(f, tile, staging, accum, row_destination);
    }
  }

  // The cooperative wgrad's bf16 tiles leave in two steps (kBoxStores, with C's tensor map map_c,
  // [groups, M, N] in (16, 64) boxes): store_holding writes a warp's first boxes and holds the
  // last kHeldBoxes in registers, and the mainloop of the consumer's next tile writes those
  // (HeldBoxesOut, its `beside`) once that tile's second wgmma group is issued; after the last
  // tile, HeldBoxesOut::write() does. Same bytes in the same places as warp stores would write.
  static constexpr int kHeldBoxes = 2;
  using Boxes = WarpBoxes<Config::BLOCK_N>;
  using HeldBoxes = typename Boxes::template Held<kHeldBoxes>;

  __device__ static void store_holding(const GroupedGemmParams& params, const GroupedTile& tile,
                                       int consumer_idx, uint8_t* staging,
                                       float (&accum)[kNumAccumulators], const CUtensorMap* map_c,
                                       HeldBoxes& held) {
    static_assert(kBoxStores, "only the wgrad's bf16 tiles leave by boxes");
    const Fragment f = fragment(params, tile, consumer_idx);
    uint32_t packed[Boxes::Rows::kPacked];
    Boxes::Rows::pack(accum, packed);
    const int warp_first_row = f.row - static_cast<int>(threadIdx.x % 32) / 4;
    Boxes::write_holding(staging + f.staging_row * kStagingRowBytes, packed, map_c,
                         tile.n_block * Config::BLOCK_N,
                         tile.mblock * Config::BLOCK_M + warp_first_row, tile.group, held);
  }

  struct HeldBoxesOut {
    uint8_t* warp_staging;  // the warp's staging rows
    const HeldBoxes& held;
    const CUtensorMap* map_c;

    __device__ HeldBoxesOut(uint8_t* staging, int consumer_idx, const HeldBoxes& held_boxes,
                            const CUtensorMap* map)
        : warp_staging(staging + warp_staging_row(consumer_idx) * kStagingRowBytes),
          held(held_boxes),
          map_c(map) {}
    __device__ void write() const { Boxes::write_held(warp_staging, held, map_c); }
    // The mainloop's `beside`.
    __device__ void fence() const {}
    __device__ void issue(int /*stage*/, int /*k16*/) const {}
    __device__ void after_second_group() const { write(); }
  };

  // Every consumer thread, after its last tile: the tile stores have landed (with map_c).
  __device__ static void drain() {
    if constexpr (kBoxStores) WarpBoxes<Config::BLOCK_N>::drain();
  }

 private:
  static constexpr bool kSwiGlu = kEpilogue == EpilogueKind::kSwiGluBf16;

  // store() for a consumer's kColumns columns: its accum[0, kColumns / 2).
  template <int kColumns, class RowDestination>
  __device__ static void store_columns(const Fragment& f, const GroupedTile& tile, uint8_t* staging,
                                       float (&accum)[kNumAccumulators],
                                       const RowDestination& row_destination) {
    if constexpr (!uses_staged_store(kEpilogue)) {
      store_fp32_fragment<kColumns>(f, f.row, f.first_column + f.column, accum);
    } else {
      using Rows = WarpRows<kColumns, kSwiGlu>;
      if constexpr (kSwiGlu) swiglu_in_place<kColumns / 2>(accum);
      // NOTE: rounded to bf16 pairs first, so that a second staging pass keeps half as many
      // registers live as the fp32 values would.
      uint32_t packed[Rows::kPacked];
      Rows::pack(accum, packed);
      const int warp_first_row = f.row - static_cast<int>(threadIdx.x % 32) / 4;  // in the tile
      // The consumer's first bf16 output column, in the C tile.
      const int first_column = kSwiGlu ? f.first_column / 2 : f.first_column;
      Rows::write(staging + f.staging_row * kStagingRowBytes, packed,
                  f.columns_valid - first_column, [&](int warp_row) -> char* {
                    const int row = warp_first_row + warp_row;
                    if (row >= f.rows_valid) return nullptr;
                    return row_destination(f, tile, row) + first_column * 2;
                  });
    }
  }
};

}  // namespace mok::gemm
