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
// rounded to bf16 as Epilogue<kForward, kStoreBf16> rounds them. Each warp passes its 16 fragment
// rows through its staging rows (`staging`, the epilogue's, free until the tile's own stores) 8
// rows and 128 columns at a time, then stores whole rows, so that every store writes full 32-byte
// sectors: stored straight from the fragment, a bf16 pair per store writes half a sector of a row
// (perf-notes/backward.md has what it cost the forward). The staged rows are
// 272 bytes apart, so that the fragment's stores (8 rows, one 16-byte vector each) hit every bank
// once with offsets known at compile time: the epilogue's XOR-swizzled rows, or packed pairs beside
// the accumulators (which the SwiGLU epilogue still needs), spilled registers.
template <class Destination>
__device__ inline void save_pre_activations(const gemm::GroupedGemmParams& params,
                                            const gemm::GroupedTile& tile, int consumer_idx,
                                            uint8_t* staging,
                                            const float (&accum)[gemm::TileConfig::BLOCK_N / 2],
                                            const Destination& destination) {
  using Store = gemm::Epilogue<gemm::GemmKind::kForward, gemm::EpilogueKind::kStoreBf16>;
  constexpr int kPassColumns = 128, kRowBytes = 2 * kPassColumns + 16;
  static_assert(8 * kRowBytes <= static_cast<int>(gemm::kWarpStagingBytes), "a warp's 8 rows");
  const typename Store::Fragment f = Store::fragment(params, tile, consumer_idx);
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int warp_first_row = f.row - lane / 4;  // in the tile
  // Lane i < 16: where the warp's row i starts (its first column), or null past the rows.
  char* row_start = nullptr;
  if (lane < 16 && warp_first_row + lane < f.rows_valid) {
    row_start = destination(f, tile, warp_first_row + lane) + f.first_column * 2;
  }
  // A half tile: each consumer holds its 128 columns (accum[0, 64)); a full tile: all 256.
  const int passes = gemm::is_half_tile<gemm::GemmKind::kForward>(tile) ? 1 : 2;
  const int columns_valid = f.columns_valid - f.first_column;
  uint8_t* warp_staging = staging + f.staging_row * gemm::kStagingRowBytes;
  uint8_t* fragment_slot = warp_staging + (lane / 4) * kRowBytes + 4 * (lane % 4);
#pragma unroll
  for (int pass = 0; pass < 2; ++pass) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      if (pass >= passes) continue;
      __syncwarp();  // the previous pass's rows (or the last tile's) have been read
#pragma unroll
      for (int vector = 0; vector < kPassColumns / 8; ++vector) {
        const int index = 4 * (pass * (kPassColumns / 8) + vector) + 2 * half;
        *reinterpret_cast<__nv_bfloat162*>(fragment_slot + 16 * vector) =
            __floats2bfloat162_rn(accum[index], accum[index + 1]);
      }
      __syncwarp();
      // Two rows per store: lanes 0-15 and 16-31, 16 bytes each.
      const int vector = lane % 16;
      const int column = pass * kPassColumns + 8 * vector;
#pragma unroll 1
      for (int row = lane / 16; row < 8; row += 2) {
        const uint4 value =
            *reinterpret_cast<const uint4*>(warp_staging + row * kRowBytes + 16 * vector);
        char* out = reinterpret_cast<char*>(
            __shfl_sync(0xffffffffu, reinterpret_cast<uintptr_t>(row_start), 8 * half + row));
        if (out != nullptr && column < columns_valid) {
          *reinterpret_cast<uint4*>(out + column * 2) = value;
        }
      }
    }
  }
}

#endif  // __CUDA_ARCH__ >= 900

}  // namespace mok::megakernel
