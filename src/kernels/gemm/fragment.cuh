// wgmma's accumulator fragment of a (64, BLOCK_N) slice, as both GEMM engines' epilogues walk it:
// in warp w of the warpgroup, lane l holds for each j < BLOCK_N / 8
//   accum[4j + 0, 4j + 1] -> row 16w + l/4,     columns 8j + 2(l%4) + {0, 1}
//   accum[4j + 2, 4j + 3] -> row 16w + l/4 + 8, the same columns
// so every access is a pair of adjacent columns.
#pragma once

#include "kernels/gemm/tile_scheduler.cuh"

namespace mok::gemm {

// Calls visit(row, column, index) for each pair this thread holds: accum[index] and
// accum[index + 1] sit at (row, column) and (row, column + 1); first_row and first_column are the
// thread's pair of j = 0 (row 16w + l/4 of the slice, column 2(l%4)), in the caller's frame.
template <int kBlockN, class Visit>
__device__ __forceinline__ void for_each_fragment_pair(int first_row, int first_column,
                                                       Visit&& visit) {
#pragma unroll
  for (int j = 0; j < kBlockN / 8; ++j) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      visit(first_row + 8 * half, first_column + 8 * j, 4 * j + 2 * half);
    }
  }
}

// The fragment's fp32 values from C (accumulating into main_grad), or into C; elements past the
// tile's valid rows or columns are left alone.
template <int kBlockN>
__device__ __forceinline__ void load_fp32_fragment(const TileInC& place, int first_row,
                                                   int first_column, float* accum) {
  for_each_fragment_pair<kBlockN>(first_row, first_column, [&](int row, int column, int index) {
    if (row < place.rows_valid && column < place.columns_valid) {
      const float2 value =
          *reinterpret_cast<const float2*>(place.tile_base + row * place.row_stride + column * 4);
      accum[index] = value.x;
      accum[index + 1] = value.y;
    }
  });
}

template <int kBlockN>
__device__ __forceinline__ void store_fp32_fragment(const TileInC& place, int first_row,
                                                    int first_column, const float* accum) {
  for_each_fragment_pair<kBlockN>(first_row, first_column, [&](int row, int column, int index) {
    if (row < place.rows_valid && column < place.columns_valid) {
      *reinterpret_cast<float2*>(place.tile_base + row * place.row_stride + column * 4) =
          make_float2(accum[index], accum[index + 1]);
    }
  });
}

}  // namespace mok::gemm
