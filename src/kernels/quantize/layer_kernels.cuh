// The FP8 layer's own quantizations (precision mode fp8, DESIGN.md §3), beside the general
// quantizers of mok/quantize.hpp, with the same per-element rule (elements.cuh) and so the same
// bytes as the CPU reference's quantize_matrix:
//
//   swiglu_quantize_kernel        h = swiglu(a, b) from the gate/up GEMM's fp32 sums, quantized
//                                 1 x 128 along I straight from fp32 (the reference's rounding
//                                 point: no bf16 rounding of h first); what the gate/up GEMM's
//                                 kSwiGluFp8 epilogue does in registers, kept as its reference
//   GateUpRows                    the row map of the weight quantizers that takes the gate/up
//                                 weight from gemm::interleave_gate_up's blocks of 8 rows to the
//                                 FP8 GEMM's blocks of 128 (gemm::kSwiGluFp8Interleave), so that
//                                 each 128 x 128 block is a block of W_gate or of W_up alone, as
//                                 the reference quantizes them
//   quantize_weight_block_kernel  the weights' 128 x 128 blocks, into the forward layout and
//                                 (for the dgrads) the transposed one from one read of the bf16
//                                 block (GateUpBlocks takes the gate/up blocks out of the
//                                 128-interleave)
//   ExpertRows, GateUp8Columns    the weight gradients' operands: 128 x 1 blocks down each
//                                 expert's own rows (the rows past its count read as zeros;
//                                 quantize_transposed_kernel's Rows policy), and d_gate_up's
//                                 columns to the gradient's gate/up rows interleaved in blocks of
//                                 8 (the fp8 SwiGLU backward's 128 x 1 outputs)
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/quantize/block2d_kernel.cuh"
#include "kernels/quantize/elements.cuh"
#include "kernels/quantize/gate_up_columns.cuh"
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

// ---- The weights: 128 x 128 blocks in both layouts ------------------------------------------

inline constexpr int kWeightBlockThreads = 256;

// The transposed layout's column block of the forward layout's row block `block`: the same.
struct SameBlocks {
  __device__ __forceinline__ int64_t operator()(int64_t block) const { return block; }
};

// The gate/up weight's: the forward layout interleaves gate and up row blocks (row block 2 b is
// gate block b, 2 b + 1 up block b); the transposed layout's columns are the gate blocks, then
// the up blocks.
struct GateUpBlocks {
  int64_t inter_blocks;  // I / 128

  __device__ __forceinline__ int64_t operator()(int64_t block) const {
    return block % 2 == 0 ? block / 2 : inter_blocks + block / 2;
  }
};

// One 128 x 128 block of `batch` bf16 matrices (rows, cols) per CTA (rows and cols multiples of
// 128; grid batch * rows / 128 * cols / 128 CTAs of kWeightBlockThreads): its scale from the
// block's amax (block2d_kernel's rule, so the same bytes as quantize_cpu), its E4M3 codes into
// data (batch, rows, cols), data row r read from input row RowMap(r), and, when data_t is not
// null, into data_t (batch, cols, rows) transposed, the block at column block
// ColumnBlocks(row block); scales (batch, rows / 128, cols / 128) and scales_t (batch, cols / 128,
// rows / 128). The bf16 block is read once: the transposed codes go through shared memory.
template <class RowMap, class ColumnBlocks>
__global__ void __launch_bounds__(kWeightBlockThreads)
    quantize_weight_block_kernel(const uint16_t* __restrict__ x, uint8_t* __restrict__ data,
                                 float* __restrict__ scales, uint8_t* __restrict__ data_t,
                                 float* __restrict__ scales_t, int64_t rows, int64_t cols,
                                 ColumnBlocks column_blocks) {
  constexpr int kVectorsPerRow = 128 / 8;                              // 16 bytes of bf16
  constexpr int kPasses = 128 * kVectorsPerRow / kWeightBlockThreads;  // 8
  constexpr int kWarps = kWeightBlockThreads / 32;
  // The block's codes, 32 words a row, word w of row r at w ^ swizzle(r): the transposed reads
  // below (a lane reads one word from each of 16 rows; the warp's lanes take 8 row groups of 16
  // and 4 words) then hit 32 banks.
  __shared__ uint32_t codes[128][32];
  __shared__ uint32_t warp_amax_bits[kWarps];
  const auto swizzle = [](int row) { return ((row / 16) & 7) << 2; };

  const int64_t col_blocks = cols / 128, row_blocks = rows / 128;
  const int64_t col_block = blockIdx.x % col_blocks;
  const int64_t row_block = blockIdx.x / col_blocks % row_blocks;
  const int64_t matrix = blockIdx.x / (col_blocks * row_blocks);
  const int64_t matrix_offset = matrix * rows * cols;
  const int vector = threadIdx.x % kVectorsPerRow;
  const int first_row = threadIdx.x / kVectorsPerRow;  // + pass * 16
  const int64_t col = col_block * 128 + vector * 8;

  uint4 raw[kPasses];  // rows first_row + 16 pass, 8 bf16 each
#pragma unroll
  for (int pass = 0; pass < kPasses; ++pass) {
    const int64_t row = row_block * 128 + first_row + pass * 16;
    raw[pass] =
        *reinterpret_cast<const uint4*>(x + matrix_offset + RowMap{}(row, rows) * cols + col);
  }
  // NOTE: at the clocks a training step leaves, the instructions per value, not DRAM, bound this
  // kernel: the maximum comes from the packed bf16 pairs, and values known finite skip the
  // encoding's NaN and Inf patch; a thread holding a non-finite value takes the general path.
  uint32_t words[4 * kPasses];
#pragma unroll
  for (int pass = 0; pass < kPasses; ++pass) {
    words[4 * pass] = raw[pass].x;
    words[4 * pass + 1] = raw[pass].y;
    words[4 * pass + 2] = raw[pass].z;
    words[4 * pass + 3] = raw[pass].w;
  }
  bool finite = true;
  uint32_t amax_bits = packed_bf16_amax_bits(words, finite);
  if (!finite) {
    amax_bits = 0;
#pragma unroll
    for (int pass = 0; pass < kPasses; ++pass) {
      float values[8];
      InputVector<uint16_t>::widen(raw[pass], values);
      amax_bits = max(amax_bits, finite_amax_bits(values));
    }
  }
  const float amax = __uint_as_float(cta_max<kWarps>(amax_bits, warp_amax_bits));
  const fp8::Fp8BlockScale scale = fp8::fp8_block_scale(amax);
  const int64_t block_index = (matrix * row_blocks + row_block) * col_blocks + col_block;
  if (threadIdx.x == 0) scales[block_index] = scale.scale;
#pragma unroll
  for (int pass = 0; pass < kPasses; ++pass) {
    const int row = first_row + pass * 16;
    float values[8];
    InputVector<uint16_t>::widen(raw[pass], values);
    uint32_t codes_of_row[2];
    encode_scaled(values, scale.inverse, finite, codes_of_row);
    store_codes<8>(data + matrix_offset + (row_block * 128 + row) * cols + col, codes_of_row);
    if (data_t != nullptr) {
      const int word = (2 * vector) ^ swizzle(row);
      *reinterpret_cast<uint2*>(&codes[row][word]) = make_uint2(codes_of_row[0], codes_of_row[1]);
    }
  }
  if (data_t == nullptr) return;
  __syncthreads();
  // Lane l of warp w: rows 16 (l % 8) .. + 15 of column word 4 w + l / 8 (columns 4 of them), as
  // four 16-byte pieces of four transposed rows.
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int group = lane % 8, column_word = threadIdx.x / 32 * 4 + lane / 8;
  uint32_t column[16];  // row 16 group + i: the word of columns 4 column_word ..
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    const int row = group * 16 + i;
    column[i] = codes[row][column_word ^ swizzle(row)];
  }
  const int64_t out_block = column_blocks(row_block);
  uint8_t* out = data_t + matrix_offset + (col_block * 128 + column_word * 4) * rows +
                 out_block * 128 + group * 16;
#pragma unroll
  for (int j = 0; j < 4; ++j) {  // column 4 column_word + j: byte j of each row's word
    uint32_t packed[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const uint32_t low = __byte_perm(column[4 * k], column[4 * k + 1], j | ((j + 4) << 4));
      const uint32_t high = __byte_perm(column[4 * k + 2], column[4 * k + 3], j | ((j + 4) << 4));
      packed[k] = __byte_perm(low, high, 0x5410);
    }
    *reinterpret_cast<uint4*>(out + j * rows) =
        make_uint4(packed[0], packed[1], packed[2], packed[3]);
  }
  if (threadIdx.x == 0) {
    scales_t[(matrix * col_blocks + col_block) * row_blocks + out_block] = scale.scale;
  }
}

}  // namespace mok::quantize
