// The FP8 layer's own quantizations (precision mode fp8, DESIGN.md §3), beside the general
// quantizers of mok/quantize.hpp, with the same per-element rule (elements.cuh) and so the same
// bytes as the CPU reference's quantize_matrix:
//
//   swiglu_quantize_kernel        h = swiglu(a, b) from the gate/up GEMM's fp32 sums, quantized
//                                 1 x 128 along I straight from fp32 (the reference's rounding
//                                 point: no bf16 rounding of h first); what the gate/up GEMM's
//                                 kSwiGluFp8 epilogue does in registers, kept as its reference
//   GateUpRows                    the row map of quantize_block2d_kernel that takes the gate/up
//                                 weight from gemm::interleave_gate_up's blocks of 8 rows to the
//                                 FP8 GEMM's blocks of 128 (gemm::kSwiGluFp8Interleave), so that
//                                 each 128 x 128 block is a block of W_gate or of W_up alone, as
//                                 the reference quantizes them
//   transpose_fp8_blocks_kernel   the dgrads' transposed weights from the forward's: the same
//                                 128 x 128 blocks and scales, bytes transposed (GateUpBlocks
//                                 takes the gate/up blocks out of the 128-interleave)
//   ExpertRows, GateUp8Columns    quantize_transposed_kernel's policies for the weight gradients'
//                                 operands: 128 x 1 blocks down each expert's own rows (the rows
//                                 past its count read as zeros), and d_gate_up's columns to the
//                                 gradient's gate/up rows interleaved in blocks of 8
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/quantize/elements.cuh"
#include "mok/detail/numerics.hpp"

namespace mok::quantize {

inline constexpr int kLayerQuantizeThreads = 256;

// Data row r of the 128-interleaved gate/up matrix (2I rows: rows 256 b .. 256 b + 127 are gate
// rows 128 b .., the next 128 the same up rows) is read from the 8-interleaved one: gate row g at
// 16 (g / 8) + g % 8, up row u at 16 (u / 8) + 8 + u % 8.
struct GateUpRows {
  __device__ __forceinline__ int64_t operator()(int64_t row, int64_t /*rows*/) const {
    const bool up = row % 256 >= 128;
    const int64_t index = row / 256 * 128 + row % 128;  // the gate or up row
    return index / 8 * 16 + (up ? 8 : 0) + index % 8;
  }
};

// gate_up (rows, 2 * inter) fp32 in the 128-interleaved column order (h column c's gate sum at
// 256 (c / 128) + c % 128, its up sum 128 further) -> h (rows, inter) E4M3 and scales (rows, inter
// / 128) fp32, h = numerics::swiglu(gate, up) (bit-identical to the host's), for the rows below
// *row_bound (device; null: rows). inter a multiple of 128. Any grid of kLayerQuantizeThreads
// threads: a warp per (row, 128-block), four values a lane. (static: a definition of its own in
// every file that includes this one, as the templates below have.)
static __global__ void __launch_bounds__(kLayerQuantizeThreads)
    swiglu_quantize_kernel(const float* __restrict__ gate_up, uint8_t* __restrict__ h,
                           float* __restrict__ scales, int64_t rows, int64_t inter,
                           const int32_t* __restrict__ row_bound) {
  const int64_t blocks_per_row = inter / 128;
  const int64_t num_rows = row_bound != nullptr ? static_cast<int64_t>(*row_bound) : rows;
  const int64_t num_items = num_rows * blocks_per_row;
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / 32);
  for (int64_t item = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
       item < num_items; item += warps) {  // (the bound is the warp's: no lane leaves alone)
    const int64_t row = item / blocks_per_row;
    const int64_t block = item % blocks_per_row, col = block * 128 + lane * 4;
    const float* sums = gate_up + row * 2 * inter + block * 256 + lane * 4;
    const float4 gate = *reinterpret_cast<const float4*>(sums);
    const float4 up = *reinterpret_cast<const float4*>(sums + 128);
    const float values[4] = {numerics::swiglu(gate.x, up.x), numerics::swiglu(gate.y, up.y),
                             numerics::swiglu(gate.z, up.z), numerics::swiglu(gate.w, up.w)};
    const float amax = __uint_as_float(lanes_max<32>(finite_amax_bits(values)));
    uint32_t words[1];
    encode_scaled(values, block_inverse<Format::kFp8>(amax), words);
    store_codes<4>(h + row * inter + col, words);
    if (lane == 0) store_scale<Format::kFp8>(scales, item, amax);
  }
}

// ---- The backward's operands ------------------------------------------------------------------

// The real rows of a tile of 128 rows from row0 in a grouped layout whose experts start on 128-row
// boundaries: the rows of the expert whose rows hold row0, up to its offset plus its count (or
// the next offset when counts is null). Tiles at or past offsets[num_experts] hold none.
struct ExpertRows {
  const int32_t* offsets;  // (num_experts + 1), device
  const int32_t* counts;   // (num_experts) or null, device
  int num_experts;

  __device__ __forceinline__ int64_t end(int64_t row0, int64_t /*in_rows*/) const {
    if (num_experts <= 0 || row0 >= offsets[num_experts]) return row0;
    // The last expert starting at or before row0 (experts without rows share the next one's
    // offset and come before it).
    int low = 0, high = num_experts - 1;
    while (low < high) {
      const int mid = (low + high + 1) / 2;
      if (offsets[mid] <= row0) {
        low = mid;
      } else {
        high = mid - 1;
      }
    }
    const int64_t count = counts != nullptr ? counts[low] : offsets[low + 1] - offsets[low];
    return offsets[low] + count;
  }
};

// d_gate_up's column `col` (the I gate columns, then the I up columns) as a row of the gate/up
// weight gradient, whose gate and up rows interleave in blocks of 8 (DeviceLayerWeights).
struct GateUp8Columns {
  int64_t inter;

  __device__ __forceinline__ int64_t operator()(int64_t col) const {
    const bool up = col >= inter;
    const int64_t index = up ? col - inter : col;
    return index / 8 * 16 + (up ? 8 : 0) + index % 8;
  }
};

inline constexpr int kTransposeBlockThreads = 256;

// The input row block that output column block `block` is made of: the same.
struct SameBlocks {
  __device__ __forceinline__ int64_t operator()(int64_t block) const { return block; }
};

// Output column blocks of the gate/up weight's transposed copy, the gate blocks then the up
// blocks, from the 128-interleaved forward layout (gate block b is row block 2 b, up block b is
// 2 b + 1).
struct GateUpBlocks {
  int64_t inter_blocks;  // I / 128

  __device__ __forceinline__ int64_t operator()(int64_t block) const {
    return block < inter_blocks ? 2 * block : 2 * (block - inter_blocks) + 1;
  }
};

// in (batch, rows, cols) E4M3 in 128 x 128 blocks, scales (batch, rows / 128, cols / 128) ->
// out (batch, cols, rows), scales (batch, cols / 128, rows / 128): out[b][c][j] =
// in[b][RowBlocks(j / 128) * 128 + j % 128][c], each block's scale with it. rows and cols
// multiples of 128. grid: batch * (rows / 128) * (cols / 128) CTAs of kTransposeBlockThreads, one
// block each through shared memory (16-byte loads and stores).
template <class RowBlocks>
__global__ void __launch_bounds__(kTransposeBlockThreads)
    transpose_fp8_blocks_kernel(const uint8_t* __restrict__ in, const float* __restrict__ in_scales,
                                uint8_t* __restrict__ out, float* __restrict__ out_scales,
                                int64_t rows, int64_t cols, RowBlocks row_blocks) {
  constexpr int kWordsPerRow = 128 / 4;
  constexpr int kVectors = 128 * 128 / 16;
  __shared__ uint32_t tile[128][kWordsPerRow + 1];  // input rows of 128 bytes, as words
  const int64_t col_blocks = cols / 128, row_block_count = rows / 128;
  const int64_t col_block = blockIdx.x % col_blocks;                    // the output's row block
  const int64_t out_block = blockIdx.x / col_blocks % row_block_count;  // its column block
  const int64_t matrix = blockIdx.x / (col_blocks * row_block_count);
  const int64_t row_block = row_blocks(out_block);
  const uint8_t* in_block = in + matrix * rows * cols + row_block * 128 * cols + col_block * 128;
  for (int vector = threadIdx.x; vector < kVectors; vector += kTransposeBlockThreads) {
    const int row = vector / 8, word = vector % 8 * 4;
    const uint4 bytes = *reinterpret_cast<const uint4*>(in_block + row * cols + word * 4);
    tile[row][word] = bytes.x;
    tile[row][word + 1] = bytes.y;
    tile[row][word + 2] = bytes.z;
    tile[row][word + 3] = bytes.w;
  }
  __syncthreads();
  uint8_t* out_block_data = out + matrix * cols * rows + col_block * 128 * rows + out_block * 128;
  for (int vector = threadIdx.x; vector < kVectors; vector += kTransposeBlockThreads) {
    const int col = vector / 8, first_row = vector % 8 * 16;  // an output row's 16 bytes
    uint32_t words[4];
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      uint32_t word = 0;
#pragma unroll
      for (int b = 0; b < 4; ++b) {
        const uint32_t byte = (tile[first_row + 4 * w + b][col / 4] >> (8 * (col % 4))) & 0xffu;
        word |= byte << (8 * b);
      }
      words[w] = word;
    }
    *reinterpret_cast<uint4*>(out_block_data + col * rows + first_row) =
        make_uint4(words[0], words[1], words[2], words[3]);
  }
  if (threadIdx.x == 0) {
    out_scales[(matrix * col_blocks + col_block) * row_block_count + out_block] =
        in_scales[(matrix * row_block_count + row_block) * col_blocks + col_block];
  }
}

}  // namespace mok::quantize
