// The transposed copy: blocks of kBlock x 1 down the input's columns (fp8: 128, mxfp8: 32), written
// as the rows of the data, data[b][n][m] = q(x[b][m][n]): the weight-gradient operand, contiguous
// along the tokens. A CTA stages a tile of 128 input rows x 256 bytes (128 bf16 or 64 fp32
// columns) in shared memory as the input's own bits, copied by cp.async: the copies in flight hold
// no registers, so each thread has its 8 16-byte loads out at once and the tile, not the register
// file, sets the bytes in flight per SM. Each thread then reads one 32-bit word column (2 bf16 or
// 1 fp32 input columns) down kSegment rows twice: once for the block amax, once to encode, and
// writes one data row segment per input column with 16-byte stores.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/ptx/cp_async.cuh"
#include "kernels/quantize/elements.cuh"

namespace mok::quantize {

inline constexpr int kTransposedThreads = 256;
// CTAs per SM the registers must allow: as many as the shared tiles fit (six of 34 KB in 228 KB).
inline constexpr int kTransposedCtasPerSm = 6;

// A tile's geometry for Input (uint16_t: bf16, float), for the kernel and its launchers.
template <class Input>
struct TransposedTile {
  static constexpr int kRows = 128;      // input rows (tokens) per tile: the data's columns
  static constexpr int kRowBytes = 256;  // of an input row per tile: 32 KB tiles of either input
  static constexpr int kCols = kRowBytes / static_cast<int>(sizeof(Input));  // the data's rows
  static constexpr int kWords = kRowBytes / 4;  // 32-bit words per tile row
  static constexpr int kColsPerWord = kCols / kWords;
  static constexpr int kVectors = kRowBytes / 16;  // 16-byte vectors per tile row
  // A thread per word column and segment: kSegment consecutive rows of the word column.
  static constexpr int kSegments = kTransposedThreads / kWords;
  static constexpr int kSegment = kRows / kSegments;

  __host__ __device__ static constexpr int64_t tiles_per_row(int64_t in_cols) {
    return (in_cols + kCols - 1) / kCols;
  }
  // The CTAs a (in_rows, in_cols) matrix takes: the grid is batch times this.
  __host__ __device__ static constexpr int64_t tiles_per_matrix(int64_t in_rows, int64_t in_cols) {
    return (in_rows + kRows - 1) / kRows * tiles_per_row(in_cols);
  }
};

// Where a tile's real input rows end (the rows from there read as zeros): at in_rows. A tile whose
// rows end at or before its first row is skipped (neither read nor written).
struct AllRows {
  __device__ __forceinline__ int64_t end(int64_t /*row0*/, int64_t in_rows) const {
    return in_rows;
  }
};

// An input element's bits, in the low bits of a word.
__device__ __forceinline__ uint32_t input_bits(uint16_t value) { return value; }
__device__ __forceinline__ uint32_t input_bits(float value) { return __float_as_uint(value); }

// grid: batch * TransposedTile<Input>::tiles_per_matrix(in_rows, in_cols) CTAs of
// kTransposedThreads. in_rows is a multiple of kBlock (describe checks it), so a segment is whole
// or absent. vector_loads: in_cols is a multiple of the input vector (else element loads). Rows:
// where each tile's real rows end (AllRows; the FP8 layer's ExpertRows).
template <class Input, Format kFormat, int kBlock, class Rows = AllRows>
__global__ void __launch_bounds__(kTransposedThreads, kTransposedCtasPerSm)
    quantize_transposed_kernel(const Input* __restrict__ x, uint8_t* __restrict__ data,
                               void* __restrict__ scales, int64_t in_rows, int64_t in_cols,
                               bool vector_loads, Rows rows = {}) {
  using Tile = TransposedTile<Input>;
  constexpr int kSegment = Tile::kSegment;
  static_assert(Tile::kWords * Tile::kSegments == kTransposedThreads && kSegment % 16 == 0,
                "a thread per word column and segment, whole 16-byte stores");
  static_assert(kBlock == kSegment || kBlock == Tile::kRows, "a block is a segment or a column");
  constexpr int kElements = InputVector<Input>::kElements;  // per 16-byte vector
  constexpr int kParts = Tile::kColsPerWord;
  constexpr int kRowsPerLoad = kTransposedThreads / Tile::kVectors;
  constexpr int kLoadsPerThread = Tile::kRows / kRowsPerLoad;
  constexpr int kGroups = kSegment / 4;  // of 4 rows: one word of codes per input column
  // NOTE: no padding: a quarter warp's 16-byte staging writes cover one row's 128 contiguous
  // bytes, and a warp's column reads 32 consecutive words of one row; both hit 32 banks.
  __shared__ alignas(16) uint32_t tile[Tile::kRows][Tile::kWords];  // (kRows, kWords) input bits
  __shared__ uint32_t segment_amax_bits[Tile::kSegments][kParts][Tile::kWords];

  const int64_t tiles_per_row = Tile::tiles_per_row(in_cols);
  const int64_t tiles_per_matrix = Tile::tiles_per_matrix(in_rows, in_cols);
  const int64_t matrix = blockIdx.x / tiles_per_matrix;
  const int64_t tile_idx = blockIdx.x % tiles_per_matrix;
  const int64_t row0 = tile_idx / tiles_per_row * Tile::kRows;
  const int64_t col0 = tile_idx % tiles_per_row * Tile::kCols;
  const Input* matrix_x = x + matrix * in_rows * in_cols;
  const int64_t row_end = rows.end(row0, in_rows);
  if (row_end <= row0) return;  // (the whole CTA: before any barrier)

  // Tile rows [0, valid_rows) are input rows; the rest read as zeros.
  const int valid_rows = static_cast<int>(min(row_end - row0, int64_t{Tile::kRows}));
  const int vector_idx = threadIdx.x % Tile::kVectors;
  const int64_t vector_col = col0 + vector_idx * kElements;
  const bool whole_vector = vector_loads && vector_col < in_cols;
  const Input* source = matrix_x + (row0 + threadIdx.x / Tile::kVectors) * in_cols + vector_col;
#pragma unroll
  for (int load = 0; load < kLoadsPerThread; ++load, source += kRowsPerLoad * in_cols) {
    const int tile_row = load * kRowsPerLoad + threadIdx.x / Tile::kVectors;
    uint32_t* destination = &tile[tile_row][vector_idx * 4];
    if (tile_row < valid_rows && whole_vector) {
      ptx::cp_async_16(destination, source);
    } else {
      uint32_t words[4] = {};  // zeros outside the input: they change no amax, go nowhere
      if (tile_row < valid_rows && !vector_loads) {
#pragma unroll
        for (int i = 0; i < kElements; ++i) {
          if (vector_col + i < in_cols) {
            words[i / kParts] |= input_bits(source[i]) << (8 * sizeof(Input) * (i % kParts));
          }
        }
      }
      *reinterpret_cast<uint4*>(destination) = make_uint4(words[0], words[1], words[2], words[3]);
    }
  }
  ptx::cp_async_wait_all();
  __syncthreads();

  const int word_idx = threadIdx.x % Tile::kWords;
  const int segment = threadIdx.x / Tile::kWords;
  const int first_row = segment * kSegment;
  // f(group, part, values) for each group of 4 rows [first_row + 4 group, + 4) and input column
  // `part` of the thread's word column, read from the tile.
  const auto for_each_group = [&](const auto& f) {
#pragma unroll
    for (int group = 0; group < kGroups; ++group) {
#pragma unroll
      for (int part = 0; part < kParts; ++part) {
        float values[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          values[i] = staged_element<Input>(tile[first_row + 4 * group + i][word_idx], part);
        }
        f(group, part, values);
      }
    }
  };
  uint32_t amax_bits[kParts] = {};
  bool finite[kParts] = {};  // every value of the thread's segment of the column (bf16 only)
  bool general = true;
  if constexpr (sizeof(Input) == 2) {
    // NOTE: bf16 words hold both columns: their maxima come from the packed pairs, two values an
    // instruction, and only a column with a NaN or Inf takes the general way below.
    static_assert(kParts == 2, "a bf16 word is two input columns");
    uint32_t halves = 0;
#pragma unroll
    for (int row = 0; row < kSegment; ++row) {
      halves = max_bf16_magnitudes(halves, tile[first_row + row][word_idx]);
    }
    const uint32_t magnitudes[kParts] = {halves & 0xffffu, halves >> 16};
    general = false;
#pragma unroll
    for (int part = 0; part < kParts; ++part) {
      finite[part] = magnitudes[part] < kBf16InfBits;
      amax_bits[part] = magnitudes[part] << 16;
      general = general || !finite[part];
    }
  }
  if (general) {
#pragma unroll
    for (int part = 0; part < kParts; ++part) amax_bits[part] = 0;
    for_each_group([&](int /*group*/, int part, const float(&values)[4]) {
      amax_bits[part] = max(amax_bits[part], finite_amax_bits(values));
    });
  }
  if constexpr (kBlock == Tile::kRows) {
#pragma unroll
    for (int part = 0; part < kParts; ++part) {
      segment_amax_bits[segment][part][word_idx] = amax_bits[part];
    }
    __syncthreads();
#pragma unroll
    for (int part = 0; part < kParts; ++part) {
#pragma unroll
      for (int other = 0; other < Tile::kSegments; ++other) {
        amax_bits[part] = max(amax_bits[part], segment_amax_bits[other][part][word_idx]);
      }
    }
  } else {
    // NOTE: the second pass reads the tile again after this fence; without it the compiler keeps
    // the first pass's words in registers, which costs occupancy (and so bytes in flight).
    __syncwarp();
  }
  const int64_t data_col = row0 + first_row;  // the segment's first input row
  if (data_col >= in_rows) return;
  float inverse[kParts];
#pragma unroll
  for (int part = 0; part < kParts; ++part) {
    inverse[part] = block_inverse<kFormat>(__uint_as_float(amax_bits[part]));
  }
  uint32_t codes[kParts][kGroups];  // (kParts, kSegment / 4) a data row segment per input column
  for_each_group([&](int group, int part, const float(&values)[4]) {
    uint32_t word[1];
    encode_scaled(values, inverse[part], finite[part], word);
    codes[part][group] = word[0];
  });
  // data (batch, in_cols, in_rows); scales (batch, in_cols, in_rows / kBlock)
#pragma unroll
  for (int part = 0; part < kParts; ++part) {
    const int64_t data_row = col0 + word_idx * kParts + part;  // the input column
    if (data_row >= in_cols) continue;
    const int64_t data_row_global = matrix * in_cols + data_row;
    store_codes<kSegment>(data + data_row_global * in_rows + data_col, codes[part]);
    if (data_col % kBlock == 0) {
      store_scale<kFormat>(scales, data_row_global * (in_rows / kBlock) + data_col / kBlock,
                           __uint_as_float(amax_bits[part]));
    }
  }
}

}  // namespace mok::quantize
