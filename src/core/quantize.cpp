// The CPU quantizers: the definition the GPU kernels (src/kernels/quantize) must match byte for
// byte. A block at a time: its largest finite magnitude, its scale, then every element.
#include "mok/quantize.hpp"

#include <algorithm>
#include <cstring>

#include "mok/bf16.hpp"
#include "mok/error.hpp"

namespace mok::quantize {

namespace {

const char* format_name(Format format) { return format == Format::kFp8 ? "fp8" : "mxfp8"; }

// Element (b, r, c) of the data, read from the input.
class InputReader {
 public:
  InputReader(const Layout& layout, const void* x, InputType type)
      : layout_(layout), x_(x), type_(type) {}

  float operator()(int64_t b, int64_t r, int64_t c) const {
    const int64_t matrix = b * layout_.rows * layout_.cols;
    const int64_t index =
        matrix + (layout_.transposed ? c * layout_.rows + r : r * layout_.cols + c);
    if (type_ == InputType::kFp32) return static_cast<const float*>(x_)[index];
    return static_cast<const bf16*>(x_)[index].to_float();
  }

 private:
  const Layout& layout_;
  const void* x_;
  InputType type_;
};

// Calls body(b, r, c) for every data element of block (b, row_block, col_block).
template <class Body>
void for_block(const Layout& layout, int64_t b, int64_t row_block, int64_t col_block, Body&& body) {
  const int64_t row_begin = row_block * layout.block_rows;
  const int64_t row_end = std::min<int64_t>(row_begin + layout.block_rows, layout.rows);
  const int64_t col_begin = col_block * layout.block_cols;
  for (int64_t r = row_begin; r < row_end; ++r) {
    for (int64_t c = col_begin; c < col_begin + layout.block_cols; ++c) body(b, r, c);
  }
}

}  // namespace

Layout describe(Format format, int64_t batch, int64_t input_rows, int64_t input_cols,
                int32_t block_rows, int32_t block_cols, bool transposed) {
  MOK_CHECK_ARG(format == Format::kFp8 || format == Format::kMxfp8, "format", "unknown format ",
                static_cast<int32_t>(format));
  MOK_CHECK_ARG(batch >= 0 && input_rows >= 0 && input_cols >= 0, "x", "negative size: batch ",
                batch, ", rows ", input_rows, ", cols ", input_cols);
  const bool fp8_rowwise = format == Format::kFp8 && block_rows == 1 && block_cols == 128;
  const bool fp8_square = format == Format::kFp8 && block_rows == 128 && block_cols == 128;
  const bool mx_rowwise = format == Format::kMxfp8 && block_rows == 1 && block_cols == 32;
  MOK_CHECK_ARG(fp8_rowwise || fp8_square || mx_rowwise, "block", format_name(format),
                " takes blocks ", format == Format::kFp8 ? "1 x 128 or 128 x 128" : "1 x 32",
                ", got ", block_rows, " x ", block_cols);
  MOK_CHECK_ARG(!(fp8_square && transposed), "block",
                "128 x 128 blocks have no transposed copy (quantize the transpose instead)");
  Layout layout;
  layout.format = format;
  layout.batch = batch;
  layout.rows = transposed ? input_cols : input_rows;
  layout.cols = transposed ? input_rows : input_cols;
  layout.block_rows = block_rows;
  layout.block_cols = block_cols;
  layout.transposed = transposed;
  MOK_CHECK_ARG(
      layout.cols % block_cols == 0, "x",
      transposed ? "rows (the transposed copy's contiguous dimension) " : "last dimension ",
      layout.cols, " is not a multiple of the block length ", block_cols);
  return layout;
}

void quantize_cpu(const Layout& layout, const void* x, InputType input_type, uint8_t* data,
                  void* scales) {
  const InputReader read(layout, x, input_type);
  const auto data_index = [&](int64_t b, int64_t r, int64_t c) {
    return (b * layout.rows + r) * layout.cols + c;
  };
  for (int64_t b = 0; b < layout.batch; ++b) {
    for (int64_t row_block = 0; row_block < layout.scale_rows(); ++row_block) {
      for (int64_t col_block = 0; col_block < layout.scale_cols(); ++col_block) {
        uint32_t amax_bits = 0;
        for_block(layout, b, row_block, col_block, [&](int64_t bb, int64_t r, int64_t c) {
          amax_bits = std::max(amax_bits, fp8::finite_magnitude_bits(read(bb, r, c)));
        });
        const float amax = numerics::bits_to_float(amax_bits);
        const int64_t scale_index =
            (b * layout.scale_rows() + row_block) * layout.scale_cols() + col_block;
        float inverse;
        if (layout.format == Format::kFp8) {
          const fp8::Fp8BlockScale scale = fp8::fp8_block_scale(amax);
          static_cast<float*>(scales)[scale_index] = scale.scale;
          inverse = scale.inverse;
        } else {
          const uint8_t code = fp8::e8m0_scale_code(amax);
          static_cast<uint8_t*>(scales)[scale_index] = code;
          inverse = fp8::e8m0_inverse(code);
        }
        for_block(layout, b, row_block, col_block, [&](int64_t bb, int64_t r, int64_t c) {
          data[data_index(bb, r, c)] = fp8::encode_e4m3(numerics::mul_rn(read(bb, r, c), inverse));
        });
      }
    }
  }
}

void dequantize_cpu(const Layout& layout, const uint8_t* data, const void* scales, float* out) {
  for (int64_t b = 0; b < layout.batch; ++b) {
    for (int64_t r = 0; r < layout.rows; ++r) {
      for (int64_t c = 0; c < layout.cols; ++c) {
        const int64_t scale_index =
            (b * layout.scale_rows() + r / layout.block_rows) * layout.scale_cols() +
            c / layout.block_cols;
        const float scale =
            layout.format == Format::kFp8
                ? static_cast<const float*>(scales)[scale_index]
                : fp8::e8m0_to_float(static_cast<const uint8_t*>(scales)[scale_index]);
        const int64_t index = (b * layout.rows + r) * layout.cols + c;
        out[index] = numerics::mul_rn(fp8::decode_e4m3(data[index]), scale);
      }
    }
  }
}

}  // namespace mok::quantize
