// The FP8 quantizers of mok's two FP8 precision modes (DESIGN.md §3), on the CPU and on the GPU,
// which give the same bytes:
//
//   fp8    E4M3 data, one fp32 scale per block: 1 x 128 along the contiguous dimension
//          (activations), 128 x 128 (weights), or 1 x 128 on the transposed copy (a 128 x 1 block
//          of the input: the weight-gradient operand, K-major along the tokens).
//          scale = max(amax, 2^-116) / 448, elements encode(x * (448 / max(amax, 2^-116))).
//   mxfp8  E4M3 data, one E8M0 scale per 1 x 32 block (OCP MX), on the data as given or on its
//          transposed copy (32 x 1 blocks of the input): scale = the smallest power of two 2^s with
//          amax <= 448 * 2^s, elements encode(x * 2^-s).
//
// amax skips NaN and +-Inf; those elements become E4M3 NaN with their sign. The element, scale and
// special-value rules: mok/detail/fp8_numerics.hpp and docs/quantize.md.
//
// Plain pointers, sizes and enums only (no std types), like torch_bridge.hpp: the torch ops include
// this header and may be linked with a core built elsewhere.
#pragma once

#include <cstdint>

#include "mok/detail/fp8_numerics.hpp"

namespace mok::quantize {

enum class Format : int32_t {
  kFp8 = 0,    // fp32 scale per 1 x 128 or 128 x 128 block
  kMxfp8 = 1,  // E8M0 scale (one byte) per 1 x 32 block
};

enum class InputType : int32_t { kBf16 = 0, kFp32 = 1 };

// A quantized tensor: `batch` matrices of data (rows, cols), E4M3 bytes, row-major, and their
// scales (batch, scale_rows, scale_cols), row-major: fp32 for kFp8, E8M0 bytes for kMxfp8. A block
// covers block_rows x block_cols data elements; the last row block may be partial (rows not a
// multiple of block_rows), cols is always a multiple of block_cols.
//
// transposed: the data is the quantization of the input's transpose: an input (batch, cols, rows)
// gives data (batch, rows, cols), data[b][r][c] = q(x[b][c][r]), so that the blocks (1 x
// block_cols) run down the input's columns. This is the copy a weight-gradient GEMM reads,
// contracting over the tokens (the input's rows), K-major.
struct Layout {
  Format format = Format::kFp8;
  int64_t batch = 0;
  int64_t rows = 0;  // of the data
  int64_t cols = 0;  // of the data, the contiguous dimension
  int32_t block_rows = 1;
  int32_t block_cols = 128;
  bool transposed = false;

  int64_t scale_rows() const { return (rows + block_rows - 1) / block_rows; }
  int64_t scale_cols() const { return cols / block_cols; }
  int64_t num_elements() const { return batch * rows * cols; }
  int64_t num_scales() const { return batch * scale_rows() * scale_cols(); }
  int64_t scale_bytes() const { return num_scales() * (format == Format::kFp8 ? 4 : 1); }
  // The input's matrix: (rows, cols), or (cols, rows) when transposed.
  int64_t input_rows() const { return transposed ? cols : rows; }
  int64_t input_cols() const { return transposed ? rows : cols; }
};

// The layout of quantizing an input of `batch` matrices (input_rows, input_cols), checked; throws
// mok::Error naming the argument ("x: ..." for the sizes, "block: ..."). Accepted:
//   kFp8,   block 1 x 128,   transposed or not: the data's cols a multiple of 128
//   kFp8,   block 128 x 128, not transposed:    the data's cols a multiple of 128
//   kMxfp8, block 1 x 32,    transposed or not: the data's cols a multiple of 32
// (the data's cols are the input's cols, or its rows when transposed).
Layout describe(Format format, int64_t batch, int64_t input_rows, int64_t input_cols,
                int32_t block_rows, int32_t block_cols, bool transposed);

// ---- CPU ----------------------------------------------------------------------------------------

// x: layout.batch input matrices (bf16 bit patterns or fp32), contiguous. data: num_elements
// bytes; scales: num_scales fp32 (kFp8) or bytes (kMxfp8).
void quantize_cpu(const Layout& layout, const void* x, InputType input_type, uint8_t* data,
                  void* scales);

// out[i] = decode_e4m3(data[i]) * scale of its block (one fp32 rounding; exact for kMxfp8 except
// where the product leaves the float range), in the data's own layout (for a transposed copy,
// the transpose of the input).
void dequantize_cpu(const Layout& layout, const uint8_t* data, const void* scales, float* out);

// ---- GPU (built with CUDA only: mok_cuda)
// --------------------------------------------------------

// The same bytes as quantize_cpu, enqueued on `stream` (a cudaStream_t; null: the default stream),
// no host synchronisation. x, data and scales are device pointers; x must be 16-byte aligned.
void quantize_gpu(const Layout& layout, const void* x, InputType input_type, uint8_t* data,
                  void* scales, void* stream);

}  // namespace mok::quantize
