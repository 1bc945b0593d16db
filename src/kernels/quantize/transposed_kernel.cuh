// The transposed copy: blocks of kBlock x 1 down the input's columns (fp8: 128, mxfp8: 32), written
// as the rows of the data, data[b][n][m] = q(x[b][m][n]): the weight-gradient operand, contiguous
// along the tokens. A CTA stages a tile of kTileRows x kTileCols input elements in shared memory
// (16-byte loads along the input's rows) and each thread then quantizes kSegment consecutive
// elements of one input column: one data row segment, written with 16-byte stores.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/quantize/elements.cuh"

namespace mok::quantize {

inline constexpr int kTransposedThreads = 256;
inline constexpr int kTileRows = 128;  // input rows (tokens) per tile: the data's columns
inline constexpr int kTileCols = 64;   // input columns per tile: the data's rows
inline constexpr int kSegment = kTileRows * kTileCols / kTransposedThreads;  // 32 per thread
inline constexpr int kSegmentsPerColumn = kTileRows / kSegment;              // 4

// Where a tile's real input rows end (the rows from there read as zeros): at in_rows. A tile whose
// rows end at or before its first row is skipped (neither read nor written).
struct AllRows {
  __device__ __forceinline__ int64_t end(int64_t /*row0*/, int64_t in_rows) const {
    return in_rows;
  }
};

// The data row of input column `col`: the same.
struct SameColumns {
  __device__ __forceinline__ int64_t operator()(int64_t col) const { return col; }
};

// grid: batch * ceil(in_rows / kTileRows) * ceil(in_cols / kTileCols) CTAs of kTransposedThreads.
// in_rows is a multiple of kBlock (describe checks it), so a segment is whole or absent.
// vector_loads: in_cols is a multiple of the input vector (else element loads). Rows: where each
// tile's real rows end (AllRows; the FP8 layer's ExpertRows); Columns: the data row each input
// column goes to, a permutation of [0, in_cols) (SameColumns; the layer's GateUp8Columns).
template <class Input, Format kFormat, int kBlock, class Rows = AllRows,
          class Columns = SameColumns>
__global__ void __launch_bounds__(kTransposedThreads)
    quantize_transposed_kernel(const Input* __restrict__ x, uint8_t* __restrict__ data,
                               void* __restrict__ scales, int64_t in_rows, int64_t in_cols,
                               bool vector_loads, Rows rows = {}, Columns columns = {}) {
  static_assert(kBlock == kSegment || kBlock == kTileRows, "a block is a segment or a tile column");
  constexpr int kElements = InputVector<Input>::kElements;
  constexpr int kVectorsPerTileRow = kTileCols / kElements;
  constexpr int kLoadsPerThread = kTileRows * kVectorsPerTileRow / kTransposedThreads;
  // NOTE: one padding word a row spreads the staging stores (a warp writes kElements consecutive
  // words in each of several rows) over more banks; the column reads hit 32 banks either way.
  __shared__ float tile[kTileRows][kTileCols + 1];  // (kTileRows, kTileCols) input elements
  __shared__ uint32_t segment_amax_bits[kSegmentsPerColumn][kTileCols];

  const int64_t tiles_per_row = (in_cols + kTileCols - 1) / kTileCols;
  const int64_t tiles_per_matrix = (in_rows + kTileRows - 1) / kTileRows * tiles_per_row;
  const int64_t matrix = blockIdx.x / tiles_per_matrix;
  const int64_t tile_idx = blockIdx.x % tiles_per_matrix;
  const int64_t row0 = tile_idx / tiles_per_row * kTileRows;
  const int64_t col0 = tile_idx % tiles_per_row * kTileCols;
  const Input* matrix_x = x + matrix * in_rows * in_cols;
  const int64_t row_end = rows.end(row0, in_rows);
  if (row_end <= row0) return;  // (the whole CTA: before any barrier)

#pragma unroll
  for (int load = 0; load < kLoadsPerThread; ++load) {
    const int vector_idx = load * kTransposedThreads + threadIdx.x;
    const int tile_row = vector_idx / kVectorsPerTileRow;
    const int tile_col = vector_idx % kVectorsPerTileRow * kElements;
    const int64_t row = row0 + tile_row, col = col0 + tile_col;
    float values[kElements] = {};  // zeros outside the input: they change no amax, go nowhere
    if (row < row_end) {
      if (vector_loads && col < in_cols) {
        InputVector<Input>::load(matrix_x + row * in_cols + col, values);
      } else if (!vector_loads) {
#pragma unroll
        for (int i = 0; i < kElements; ++i) {
          if (col + i < in_cols)
            values[i] = InputVector<Input>::load_one(matrix_x + row * in_cols + col + i);
        }
      }
    }
#pragma unroll
    for (int i = 0; i < kElements; ++i) tile[tile_row][tile_col + i] = values[i];
  }
  __syncthreads();

  const int tile_col = threadIdx.x % kTileCols;
  const int segment = threadIdx.x / kTileCols;
  const int64_t data_row = col0 + tile_col;            // the input column
  const int64_t data_col = row0 + segment * kSegment;  // the segment's first input row
  const bool active = data_row < in_cols && data_col < in_rows;
  float values[kSegment];  // (kSegment,) down the input column
#pragma unroll
  for (int i = 0; i < kSegment; ++i) values[i] = tile[segment * kSegment + i][tile_col];
  uint32_t amax_bits = finite_amax_bits(values);
  if constexpr (kBlock == kTileRows) {
    segment_amax_bits[segment][tile_col] = amax_bits;
    __syncthreads();
#pragma unroll
    for (int other = 0; other < kSegmentsPerColumn; ++other) {
      amax_bits = max(amax_bits, segment_amax_bits[other][tile_col]);
    }
  }
  if (!active) return;
  const float amax = __uint_as_float(amax_bits);
  // data (batch, in_cols, in_rows); scales (batch, in_cols, in_rows / kBlock)
  const int64_t data_row_global = matrix * in_cols + columns(data_row);
  uint32_t words[kSegment / 4];
  encode_scaled(values, block_inverse<kFormat>(amax), words);
  store_codes<kSegment>(data + data_row_global * in_rows + data_col, words);
  if (data_col % kBlock == 0) {
    store_scale<kFormat>(scales, data_row_global * (in_rows / kBlock) + data_col / kBlock, amax);
  }
}

}  // namespace mok::quantize
