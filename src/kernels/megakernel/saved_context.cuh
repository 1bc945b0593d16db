// Save mode: the fused forward's gate/up tiles also keep their pre-activations (a, b: the fp32
// accumulators rounded to bf16, gate and up columns interleaved by 8 as the GEMM computes them)
// for the backward, which then skips its gate/up recompute. The values are the ones the backward's
// recompute rounds (the same sums in the same k order; wgmma's N does not change an element), so
// both modes give the same bits.
//
// Where a row goes: the routed rows by their source, row (src_rank * T_max + t) * k + j of the
// context (the workspace's row_source value; no padding rows and, at EP 1, exactly T * k rows);
// the shared expert's rows by token.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/gemm/epilogue.cuh"
#include "kernels/gemm/gemm_types.cuh"
#include "kernels/gemm/tile_scheduler.cuh"

namespace mok::megakernel {

struct RowsToSavedContext {
  const int32_t* row_source;  // the workspace's, for routed rows; null: rows are tokens
  char* context;              // (rows, 2I) bf16
  int64_t row_bytes;          // 2I * 2
  int64_t first_row;          // the tile's first row in the call's expert rows (or tokens)

  template <class Fragment>
  __device__ char* operator()(const Fragment& f, const gemm::GroupedTile& /*tile*/,
                              int tile_row) const {
    const int64_t row = first_row + tile_row;
    // A row inside the expert's count always has a source (padding rows lie past it).
    const int64_t index = row_source != nullptr ? row_source[row] : row;
    return context + index * row_bytes + f.column_bytes;
  }
  // The rows of the row block `blocks` on (a carried tail's).
  __device__ RowsToSavedContext block(int blocks) const {
    return {row_source, context, row_bytes, first_row + blocks * gemm::TileConfig::BLOCK_M};
  }
};

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900

// A consumer warpgroup's gate/up accumulators (before SwiGLU overwrites them) to `destination`,
// rounded to bf16 as Epilogue<kForward, kStoreBf16> rounds them, but stored straight from the
// fragment (a bf16 pair per store): staged like the epilogue's, the packed pairs beside the
// accumulators, which the SwiGLU epilogue still needs, spilled ~670 bytes per consumer thread.
template <class Destination>
__device__ inline void save_pre_activations(const gemm::GroupedGemmParams& params,
                                            const gemm::GroupedTile& tile, int consumer_idx,
                                            const float (&accum)[gemm::TileConfig::BLOCK_N / 2],
                                            const Destination& destination) {
  using Store = gemm::Epilogue<gemm::GemmKind::kForward, gemm::EpilogueKind::kStoreBf16>;
  const typename Store::Fragment f = Store::fragment(params, tile, consumer_idx);
  // A half tile: each consumer holds its 128 columns (accum[0, 64)); a full tile: all 256.
  const int columns = gemm::is_half_tile<gemm::GemmKind::kForward>(tile)
                          ? gemm::TileConfig::BLOCK_N / 2
                          : gemm::TileConfig::BLOCK_N;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int row = f.row + 8 * half;
    if (row >= f.rows_valid) continue;
    char* row_start = destination(f, tile, row) + (f.first_column + f.column) * 2;
#pragma unroll
    for (int j = 0; j < gemm::TileConfig::BLOCK_N / 8; ++j) {
      const int column = f.first_column + f.column + 8 * j;  // in the C tile
      if (8 * j >= columns || column >= f.columns_valid) continue;
      const int index = 4 * j + 2 * half;
      *reinterpret_cast<__nv_bfloat162*>(row_start + 16 * j) =
          __floats2bfloat162_rn(accum[index], accum[index + 1]);
    }
  }
}

#endif  // __CUDA_ARCH__ >= 900

}  // namespace mok::megakernel
