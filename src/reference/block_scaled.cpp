#include "reference/block_scaled.hpp"

#include <algorithm>

#include "mok/detail/fp8_numerics.hpp"
#include "mok/error.hpp"

namespace mok::reference {

QuantizedMatrix quantize_matrix(const BlockScaling& scaling, const float* values, int64_t rows,
                                int64_t cols) {
  MOK_CHECK_ARG(scaling.block_rows >= 0 && scaling.block_cols >= 0, "block", "negative block size ",
                scaling.block_rows, " x ", scaling.block_cols);
  QuantizedMatrix out;
  out.rows = rows;
  out.cols = cols;
  out.block_rows = scaling.block_rows > 0 ? scaling.block_rows : std::max<int64_t>(rows, 1);
  out.block_cols = scaling.block_cols > 0 ? scaling.block_cols : std::max<int64_t>(cols, 1);
  const int64_t row_blocks = (rows + out.block_rows - 1) / out.block_rows;
  const int64_t k_blocks = out.num_k_blocks();
  const bool mx = scaling.format == quantize::Format::kMxfp8;
  out.codes.resize(static_cast<size_t>(rows * cols));
  out.values.resize(static_cast<size_t>(rows * cols));
  out.scales.resize(static_cast<size_t>(row_blocks * k_blocks));
  if (mx) out.scale_codes.resize(out.scales.size());

  for (int64_t row_block = 0; row_block < row_blocks; ++row_block) {
    const int64_t row_begin = row_block * out.block_rows;
    const int64_t row_end = std::min(row_begin + out.block_rows, rows);
    for (int64_t k_block = 0; k_block < k_blocks; ++k_block) {
      const int64_t col_begin = k_block * out.block_cols;
      const int64_t col_end = std::min(col_begin + out.block_cols, cols);
      uint32_t amax_bits = 0;
      for (int64_t r = row_begin; r < row_end; ++r) {
        for (int64_t c = col_begin; c < col_end; ++c) {
          amax_bits = std::max(amax_bits, fp8::finite_magnitude_bits(values[r * cols + c]));
        }
      }
      const float amax = numerics::bits_to_float(amax_bits);
      const int64_t scale_idx = row_block * k_blocks + k_block;
      float inverse;
      if (mx) {
        const uint8_t code = fp8::e8m0_scale_code(amax);
        out.scale_codes[scale_idx] = code;
        out.scales[scale_idx] = fp8::e8m0_to_float(code);
        inverse = fp8::e8m0_inverse(code);
      } else {
        const fp8::Fp8BlockScale scale = fp8::fp8_block_scale(amax);
        out.scales[scale_idx] = scale.scale;
        inverse = scale.inverse;
      }
      for (int64_t r = row_begin; r < row_end; ++r) {
        for (int64_t c = col_begin; c < col_end; ++c) {
          const uint8_t code = fp8::encode_e4m3(numerics::mul_rn(values[r * cols + c], inverse));
          out.codes[r * cols + c] = code;
          out.values[r * cols + c] = fp8::decode_e4m3(code);
        }
      }
    }
  }
  return out;
}

}  // namespace mok::reference
