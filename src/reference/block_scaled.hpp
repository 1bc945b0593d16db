// Block-scaled E4M3 operands and the GEMM dot product the FP8 precision modes compute with
// (DESIGN.md §3, docs/quantize.md "The layer in FP8"). A GEMM operand is a matrix with K
// contiguous, (rows, K), quantized in blocks of block_rows x block_cols; the two operands of one
// GEMM share the K blocking, and the sum over K is promoted once per K block:
//
//   P   = sum over k in the block of decode(a[k]) * decode(b[k])   fp32, k in order
//   acc = fma(P, scale_a * scale_b, acc)                             blocks in order
//
// as the GPU's FP8 GEMM promotes its tensor-core block sums (src/kernels/gemm/fp8_mainloop.cuh).
// Products of E4M3 values are exact in fp32, so only the sums round.
#pragma once

#include <cstdint>
#include <type_traits>
#include <vector>

#include "mok/detail/numerics.hpp"
#include "mok/quantize.hpp"

namespace mok::reference {

// How one operand is quantized: blocks of block_rows x block_cols (along K). 0 = the whole
// dimension (one scale per row over all of K: the rowwise recipe the tests compare with).
struct BlockScaling {
  quantize::Format format = quantize::Format::kFp8;
  int64_t block_rows = 1;
  int64_t block_cols = 128;
};

struct QuantizedMatrix {
  int64_t rows = 0, cols = 0;
  int64_t block_rows = 1, block_cols = 1;  // resolved: never 0
  std::vector<uint8_t> codes;              // (rows, cols) E4M3 bytes
  std::vector<float> values;               // (rows, cols) decode_e4m3(codes), exact
  std::vector<float> scales;               // (row blocks, k blocks) the scale as a float
  std::vector<uint8_t> scale_codes;        // (row blocks, k blocks) E8M0 codes; mxfp8 only

  int64_t num_k_blocks() const { return (cols + block_cols - 1) / block_cols; }
  const float* row(int64_t row_idx) const { return values.data() + row_idx * cols; }
  float scale(int64_t row_idx, int64_t k_block) const {
    return scales[(row_idx / block_rows) * num_k_blocks() + k_block];
  }
};

// Quantizes `values` (rows, cols), row-major, by the rules of mok/quantize.hpp (amax over the
// block's finite values, fp8_block_scale or e8m0_scale_code, encode_e4m3 of value * inverse):
// for the block shapes mok::quantize accepts, its bytes and scales exactly. Partial last blocks
// (rows or cols not a multiple of the block) are quantized as if padded with zeros.
QuantizedMatrix quantize_matrix(const BlockScaling& scaling, const float* values, int64_t rows,
                                int64_t cols);

// The promoted block-scaled dot product of row a_row of `a` and row b_row of `b`, starting from
// `start` (0, or a main_grad value). Real = float: the GPU's rounding points above; Real =
// double: the same sum of dequantized products in fp64 (the tests' quantize-then-fp64 oracle).
template <class Real>
Real block_scaled_dot(const QuantizedMatrix& a, int64_t a_row, const QuantizedMatrix& b,
                      int64_t b_row, Real start = 0) {
  const float* a_values = a.row(a_row);
  const float* b_values = b.row(b_row);
  Real accum = start;
  for (int64_t k_block = 0; k_block < a.num_k_blocks(); ++k_block) {
    const int64_t begin = k_block * a.block_cols;
    const int64_t end = begin + a.block_cols < a.cols ? begin + a.block_cols : a.cols;
    Real partial = 0;
    for (int64_t k = begin; k < end; ++k) {
      partial = partial + static_cast<Real>(a_values[k]) * static_cast<Real>(b_values[k]);
    }
    if constexpr (std::is_same_v<Real, float>) {
      const float scale = numerics::mul_rn(a.scale(a_row, k_block), b.scale(b_row, k_block));
      accum = numerics::fma_rn(partial, scale, accum);
    } else {
      accum = accum + partial * (static_cast<double>(a.scale(a_row, k_block)) *
                                 static_cast<double>(b.scale(b_row, k_block)));
    }
  }
  return accum;
}

}  // namespace mok::reference
