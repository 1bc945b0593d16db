// fp8 weights: one fp32 scale per 128 x 128 block of each matrix, one CTA per block. Every thread
// holds kPasses rows of one 16-byte column vector of the block; the amax goes round the warp by
// shuffles and across the eight warps through shared memory. The last row block of a matrix may
// be partial (rows past the end are neither read nor written).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/quantize/elements.cuh"

namespace mok::quantize {

inline constexpr int kBlock2d = 128;
inline constexpr int kBlock2dThreads = 256;

// Where a matrix's row `row` (of `rows`) is read from: the same row.
struct SameRows {
  __device__ __forceinline__ int64_t operator()(int64_t row, int64_t /*rows*/) const { return row; }
};

// grid: batch * scale_rows * scale_cols CTAs of kBlock2dThreads threads. RowMap: the input row each
// data row is read from (a permutation of the matrix's rows); the data and scales are in the
// data's row order.
template <class Input, class RowMap = SameRows>
__global__ void __launch_bounds__(kBlock2dThreads)
    quantize_block2d_kernel(const Input* __restrict__ x, uint8_t* __restrict__ data,
                            float* __restrict__ scales, int64_t rows, int64_t cols,
                            int64_t scale_rows, int64_t scale_cols) {
  constexpr int kElements = InputVector<Input>::kElements;
  constexpr int kVectorsPerRow = kBlock2d / kElements;
  constexpr int kRowsPerPass = kBlock2dThreads / kVectorsPerRow;
  constexpr int kPasses = kBlock2d / kRowsPerPass;
  constexpr int kWarps = kBlock2dThreads / 32;
  __shared__ uint32_t warp_amax_bits[kWarps];

  const int64_t block_idx = blockIdx.x;  // (batch, scale_rows, scale_cols) flattened
  const int64_t col_block = block_idx % scale_cols;
  const int64_t row_block = block_idx / scale_cols % scale_rows;
  const int64_t matrix = block_idx / (scale_cols * scale_rows);
  const int64_t first_row = row_block * kBlock2d + threadIdx.x / kVectorsPerRow;
  const int64_t col = col_block * kBlock2d + threadIdx.x % kVectorsPerRow * kElements;
  const int64_t matrix_offset = matrix * rows * cols;

  float values[kPasses][kElements] =
      {};  // (kPasses, kElements): rows first_row + pass * kRowsPerPass
  uint32_t amax_bits = 0;
#pragma unroll
  for (int pass = 0; pass < kPasses; ++pass) {
    const int64_t row = first_row + pass * kRowsPerPass;
    if (row < rows) {
      InputVector<Input>::load(x + matrix_offset + RowMap{}(row, rows) * cols + col, values[pass]);
      amax_bits = max(amax_bits, finite_amax_bits(values[pass]));
    }
  }
  const float amax = __uint_as_float(cta_max<kWarps>(amax_bits, warp_amax_bits));
  const fp8::Fp8BlockScale scale = fp8::fp8_block_scale(amax);
  if (threadIdx.x == 0) scales[block_idx] = scale.scale;
#pragma unroll
  for (int pass = 0; pass < kPasses; ++pass) {
    const int64_t row = first_row + pass * kRowsPerPass;
    if (row < rows) {
      uint32_t words[kElements / 4];
      encode_scaled(values[pass], scale.inverse, words);
      store_codes<kElements>(data + matrix_offset + row * cols + col, words);
    }
  }
}

}  // namespace mok::quantize
