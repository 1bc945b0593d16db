// The FP8 quantizers' CPU definition (mok/quantize.hpp, mok/detail/fp8_numerics.hpp): the E4M3
// encoder against a plain nearest-value search over the 254 finite codes, on every bf16 and on
// every float next to a rounding boundary; the E8M0 scale against a search over powers of two;
// then whole tensors: layouts, the transposed copy, special values and round-trip error bounds.
#include <gtest/gtest.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "mok/detail/fp8_numerics.hpp"
#include "mok/error.hpp"
#include "mok/quantize.hpp"
#include "quantize_cases.hpp"

namespace mok::quantize_test {
namespace {

using quantize::Format;
using quantize::InputType;
using quantize::Layout;

// ---- independent references ---------------------------------------------------------------------

// The value of E4M3 code 0..0x7e (positive, finite), from the format's definition.
double e4m3_value(int code) {
  const int exponent = code >> 3, mantissa = code & 7;
  if (exponent == 0) return std::ldexp(mantissa, -9);
  return std::ldexp(1.0 + mantissa / 8.0, exponent - 7);
}

// Nearest finite code, ties to the even code (the one whose mantissa ends in 0); above 448:
// 448; NaN and +-Inf: NaN with the sign.
uint8_t reference_e4m3(float x) {
  const uint8_t sign = std::signbit(x) ? 0x80 : 0x00;
  if (!std::isfinite(x)) return sign | 0x7f;
  const double magnitude = std::fabs(static_cast<double>(x));
  static const std::vector<double> values = [] {
    std::vector<double> table;
    for (int code = 0; code <= 0x7e; ++code) table.push_back(e4m3_value(code));
    return table;
  }();
  if (magnitude >= 448.0) return sign | 0x7e;
  // the largest code whose value is <= magnitude, then the nearer of it and the next
  const int below =
      static_cast<int>(std::upper_bound(values.begin(), values.end(), magnitude) - values.begin()) -
      1;
  const double midpoint = (values[below] + values[below + 1]) / 2;  // exact in double
  int code = below;
  if (magnitude > midpoint || (magnitude == midpoint && (below & 1))) code = below + 1;
  return sign | static_cast<uint8_t>(code);
}

// The smallest e in [0, 254] with amax <= 448 * 2^(e - 127).
int reference_e8m0(float amax) {
  for (int e = 0; e <= 254; ++e) {
    if (static_cast<double>(amax) <= std::ldexp(448.0, e - 127)) return e;
  }
  return 255;
}

// ---- E4M3 ---------------------------------------------------------------------------------------

TEST(QuantizeE4M3, EncodesEveryBf16AsTheNearestEvenReference) {
  int mismatches = 0;
  for (uint32_t bits = 0; bits < 0x10000u; ++bits) {
    const float x = float_of_bits(bits << 16);
    if (fp8::encode_e4m3(x) != reference_e4m3(x) && ++mismatches < 10) {
      ADD_FAILURE() << "bf16 0x" << std::hex << bits << ": encode 0x" << int(fp8::encode_e4m3(x))
                    << ", reference 0x" << int(reference_e4m3(x));
    }
  }
  EXPECT_EQ(mismatches, 0);
}

// Every rounding decision sits at bit 20 of the float mantissa or higher (bits 21..24 for E4M3
// subnormals), so floats with every pattern of the upper 20 bits and the lower 12 bits at and
// next to 0, half and all-ones reach every tie and the floats one ulp either side of it.
TEST(QuantizeE4M3, EncodesEveryFloatNearARoundingBoundaryAsTheReference) {
  const uint32_t low_patterns[] = {0x000, 0x001, 0x7ff, 0x800, 0x801, 0xfff};
  int64_t mismatches = 0, checked = 0;
  for (uint32_t high = 0; high < (1u << 20); ++high) {
    for (uint32_t low : low_patterns) {
      const float x = float_of_bits(high << 12 | low);
      ++checked;
      if (fp8::encode_e4m3(x) != reference_e4m3(x) && ++mismatches < 10) {
        ADD_FAILURE() << "float bits 0x" << std::hex << bits_of(x) << ": encode 0x"
                      << int(fp8::encode_e4m3(x)) << ", reference 0x" << int(reference_e4m3(x));
      }
    }
  }
  EXPECT_EQ(mismatches, 0) << "of " << checked;
}

TEST(QuantizeE4M3, DecodesEveryCodeExactlyAndEncodesItBack) {
  for (int code = 0; code < 256; ++code) {
    const float value = fp8::decode_e4m3(static_cast<uint8_t>(code));
    if ((code & 0x7f) == 0x7f) {
      EXPECT_TRUE(std::isnan(value)) << code;
      EXPECT_EQ(std::signbit(value), code >= 0x80) << code;
      continue;
    }
    const double expected = (code & 0x80 ? -1 : 1) * e4m3_value(code & 0x7f);
    EXPECT_EQ(static_cast<double>(value), expected) << code;
    EXPECT_EQ(std::signbit(value), code >= 0x80) << code;  // 0x80 is -0
    EXPECT_EQ(fp8::encode_e4m3(value), code) << code;
  }
}

TEST(QuantizeE4M3, SpecialValuesHaveTheDocumentedCodes) {
  const float inf = std::numeric_limits<float>::infinity();
  EXPECT_EQ(fp8::encode_e4m3(std::nanf("")), 0x7f);
  EXPECT_EQ(fp8::encode_e4m3(-std::nanf("")), 0xff);
  EXPECT_EQ(fp8::encode_e4m3(inf), 0x7f);  // E4M3 fn has no infinity: NaN, not 448
  EXPECT_EQ(fp8::encode_e4m3(-inf), 0xff);
  EXPECT_EQ(fp8::encode_e4m3(448.0f), 0x7e);
  EXPECT_EQ(fp8::encode_e4m3(464.0f), 0x7e);  // a tie between 448 and 480 (no such value): even
  EXPECT_EQ(fp8::encode_e4m3(-1e30f), 0xfe);  // finite magnitudes saturate
  EXPECT_EQ(fp8::encode_e4m3(FLT_MAX), 0x7e);
  EXPECT_EQ(fp8::encode_e4m3(0.0f), 0x00);
  EXPECT_EQ(fp8::encode_e4m3(-0.0f), 0x80);
  EXPECT_EQ(fp8::encode_e4m3(-FLT_TRUE_MIN), 0x80);  // rounds to zero, keeps the sign
  EXPECT_EQ(fp8::encode_e4m3(0x1p-10f), 0x00);       // half the smallest subnormal: even, 0
  EXPECT_EQ(fp8::encode_e4m3(0x1.8p-9f), 0x02);      // 1.5 * 2^-9: even, 2 * 2^-9
  EXPECT_EQ(fp8::encode_e4m3(0x1.4p-8f), 0x02);      // 2.5 * 2^-9: even, 2 * 2^-9
  EXPECT_EQ(fp8::encode_e4m3(0x1.ep-7f), 0x08);      // 7.5 * 2^-9: up to the smallest normal
  EXPECT_EQ(fp8::encode_e4m3(1.0f), 0x38);
  EXPECT_EQ(fp8::encode_e4m3(1.0625f), 0x38);  // tie between 1 and 1.125: even
  EXPECT_EQ(fp8::encode_e4m3(1.1875f), 0x3a);  // tie between 1.125 and 1.25: even
}

// ---- scales -------------------------------------------------------------------------------------

TEST(QuantizeScale, E8M0IsThePowerOfTwoRoundedUp) {
  std::vector<float> amaxes = {0.0f, FLT_TRUE_MIN, FLT_MIN, 1.0f, 1.75f, 448.0f, 449.0f, FLT_MAX};
  for (uint32_t bits = 0; bits < 0x7f80u; ++bits) amaxes.push_back(float_of_bits(bits << 16));
  for (float base : {448.0f, 1.75f, 0x1.cp-100f, 0x1.cp100f}) {  // m = 1.75 boundaries
    amaxes.push_back(base);
    amaxes.push_back(std::nextafter(base, 0.0f));
    amaxes.push_back(std::nextafter(base, FLT_MAX));
  }
  std::mt19937 generator(7);
  std::uniform_int_distribution<uint32_t> bits(0, 0x7f7fffffu);
  for (int i = 0; i < 200000; ++i) amaxes.push_back(float_of_bits(bits(generator)));
  for (float amax : amaxes) {
    const int code = fp8::e8m0_scale_code(amax);
    ASSERT_EQ(code, reference_e8m0(amax)) << "amax " << amax;
    ASSERT_LE(code, 247) << "amax " << amax;
    const double scale = std::ldexp(1.0, code - 127);
    EXPECT_LE(amax / scale, 448.0) << "amax " << amax;  // nothing saturates
    EXPECT_EQ(static_cast<double>(fp8::e8m0_to_float(static_cast<uint8_t>(code))), scale);
    EXPECT_EQ(static_cast<double>(fp8::e8m0_inverse(static_cast<uint8_t>(code))), 1.0 / scale);
  }
  EXPECT_EQ(fp8::e8m0_scale_code(448.0f), 127);  // exactly 448: scale 1
  EXPECT_EQ(fp8::e8m0_scale_code(449.0f), 128);
  EXPECT_EQ(fp8::e8m0_scale_code(0.0f), 0);  // a zero block: 2^-127
  EXPECT_TRUE(std::isnan(fp8::e8m0_to_float(0xff)));
}

TEST(QuantizeScale, Fp8ScaleIsAmaxOver448WithAFloor) {
  const fp8::Fp8BlockScale unit = fp8::fp8_block_scale(448.0f);
  EXPECT_EQ(unit.scale, 1.0f);
  EXPECT_EQ(unit.inverse, 1.0f);
  const fp8::Fp8BlockScale three = fp8::fp8_block_scale(3.0f);
  EXPECT_EQ(three.scale, 3.0f / 448.0f);
  EXPECT_EQ(three.inverse, 448.0f / 3.0f);
  for (float amax : {0.0f, FLT_TRUE_MIN, 0x1p-120f, 0x1p-116f}) {  // all at the floor
    const fp8::Fp8BlockScale floor = fp8::fp8_block_scale(amax);
    EXPECT_EQ(floor.scale, 0x1p-116f / 448.0f) << amax;
    EXPECT_EQ(floor.inverse, 448.0f / 0x1p-116f) << amax;
    EXPECT_GE(floor.scale, FLT_MIN);  // both normal floats
    EXPECT_TRUE(std::isfinite(floor.inverse));
  }
  const fp8::Fp8BlockScale top = fp8::fp8_block_scale(FLT_MAX);
  EXPECT_TRUE(std::isfinite(top.scale) && top.inverse > 0.0f);
}

// ---- tensors ------------------------------------------------------------------------------------

struct Quantized {
  std::vector<uint8_t> data;
  std::vector<float> fp8_scales;
  std::vector<uint8_t> mx_scales;
  float scale(const Layout& layout, int64_t index) const {
    return layout.format == Format::kFp8 ? fp8_scales[index] : fp8::e8m0_to_float(mx_scales[index]);
  }
  void* scales(const Layout& layout) {
    return layout.format == Format::kFp8 ? static_cast<void*>(fp8_scales.data())
                                         : static_cast<void*>(mx_scales.data());
  }
};

// Outputs filled with `poison` first (two runs with different poisons show every byte written).
template <class Input>
Quantized quantize_values(const Layout& layout, const std::vector<Input>& x, uint8_t poison) {
  Quantized out;
  out.data.assign(layout.num_elements(), poison);
  out.fp8_scales.assign(layout.format == Format::kFp8 ? layout.num_scales() : 0,
                        float_of_bits(poison * 0x01010101u));
  out.mx_scales.assign(layout.format == Format::kMxfp8 ? layout.num_scales() : 0, poison);
  const InputType type = sizeof(Input) == 4 ? InputType::kFp32 : InputType::kBf16;
  quantize::quantize_cpu(layout, x.data(), type, out.data.data(), out.scales(layout));
  return out;
}

Quantized quantize_floats(const Layout& layout, const std::vector<float>& x, uint8_t poison) {
  return quantize_values(layout, x, poison);
}

bool same_bytes(const Quantized& a, const Quantized& b) {
  return a.data == b.data && a.mx_scales == b.mx_scales &&
         std::equal(a.fp8_scales.begin(), a.fp8_scales.end(), b.fp8_scales.begin(),
                    b.fp8_scales.end(), [](float u, float v) { return bits_of(u) == bits_of(v); });
}

struct Variant {
  const char* name;
  Format format;
  int32_t block_rows, block_cols;
  bool transposed;
};

const Variant kVariants[] = {
    {"fp8 1x128", Format::kFp8, 1, 128, false},
    {"fp8 128x128", Format::kFp8, 128, 128, false},
    {"fp8 1x128 transposed", Format::kFp8, 1, 128, true},
    {"mxfp8 1x32", Format::kMxfp8, 1, 32, false},
    {"mxfp8 1x32 transposed", Format::kMxfp8, 1, 32, true},
};

// Inputs of `batch` matrices (200, 256), or (256, 200) for a transposed copy (its rows, the
// copy's contiguous dimension, a multiple of the block): a partial 128-row block for 128 x 128,
// partial tiles for the GPU's transposed kernel.
Layout layout_of(const Variant& variant, int64_t batch) {
  const int64_t rows = variant.transposed ? 256 : 200, cols = variant.transposed ? 200 : 256;
  return quantize::describe(variant.format, batch, rows, cols, variant.block_rows,
                            variant.block_cols, variant.transposed);
}

// Every element's dequantized value against the input: NaN for a non-finite input, else within
// half an E4M3 step of the scaled value (relative 2^-4 in the normal range, 2^-10 of the scale
// below it), plus the fp32 roundings of the fp8 scale and of its inverse.
TEST(QuantizeTensor, RoundTripIsWithinHalfAnE4M3Step) {
  for (const Variant& variant : kVariants) {
    SCOPED_TRACE(variant.name);
    const Layout layout = layout_of(variant, 2);
    const std::vector<float> x = random_values(layout.num_elements(), 96, 11);
    Quantized q = quantize_floats(layout, x, 0xaa);
    std::vector<float> out(layout.num_elements());
    quantize::dequantize_cpu(layout, q.data.data(), q.scales(layout), out.data());
    int failures = 0;
    for (int64_t b = 0; b < layout.batch; ++b) {
      for (int64_t r = 0; r < layout.rows; ++r) {
        for (int64_t c = 0; c < layout.cols; ++c) {
          const int64_t index = (b * layout.rows + r) * layout.cols + c;
          const int64_t input_index =
              b * layout.rows * layout.cols +
              (layout.transposed ? c * layout.rows + r : r * layout.cols + c);
          const float input = x[input_index];
          const float scale = q.scale(
              layout, (b * layout.scale_rows() + r / layout.block_rows) * layout.scale_cols() +
                          c / layout.block_cols);
          bool ok;
          if (!std::isfinite(input)) {
            ok = std::isnan(out[index]) && std::signbit(out[index]) == std::signbit(input);
          } else if (std::isinf(out[index])) {
            // within one E4M3 step of FLT_MAX the product may pass it (docs/quantize.md)
            ok = std::fabs(input) >= 0x1.8p127f && std::signbit(out[index]) == std::signbit(input);
          } else {
            const double error = std::fabs(static_cast<double>(out[index]) - input);
            const double bound =
                std::max(std::fabs(input) * 0x1p-4, scale * 0x1p-10) * (1 + 0x1p-20) +
                std::fabs(input) * 0x1p-21;
            ok = error <= bound &&
                 (out[index] == 0 || std::signbit(out[index]) == std::signbit(input));
          }
          if (!ok && ++failures < 5) {
            ADD_FAILURE() << "element (" << b << ", " << r << ", " << c << "): input " << input
                          << ", dequantized " << out[index] << ", scale " << scale;
          }
        }
      }
    }
    EXPECT_EQ(failures, 0);
  }
}

TEST(QuantizeTensor, WritesEveryByteAndBf16InputsMatchTheirFloats) {
  for (const Variant& variant : kVariants) {
    SCOPED_TRACE(variant.name);
    const Layout layout = layout_of(variant, 3);
    const std::vector<bf16> x16 = to_bf16(random_values(layout.num_elements(), 64, 5));
    std::vector<float> x32(x16.size());
    for (size_t i = 0; i < x16.size(); ++i) x32[i] = x16[i].to_float();
    const Quantized from_bf16 = quantize_values(layout, x16, 0x00);
    EXPECT_TRUE(same_bytes(from_bf16, quantize_values(layout, x16, 0xff)));
    EXPECT_TRUE(same_bytes(from_bf16, quantize_floats(layout, x32, 0x5a)));
  }
}

// The transposed copy of x is the quantization of x's transpose, byte for byte.
TEST(QuantizeTensor, TransposedCopyIsTheQuantizedTranspose) {
  for (Format format : {Format::kFp8, Format::kMxfp8}) {
    const int32_t block = format == Format::kFp8 ? 128 : 32;
    const int64_t batch = 2, rows = 256, cols = 96;  // input (batch, rows, cols)
    const std::vector<float> x = random_values(batch * rows * cols, 40, 3);
    std::vector<float> x_t(x.size());
    for (int64_t b = 0; b < batch; ++b) {
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t c = 0; c < cols; ++c) {
          x_t[(b * cols + c) * rows + r] = x[(b * rows + r) * cols + c];
        }
      }
    }
    const Layout transposed = quantize::describe(format, batch, rows, cols, 1, block, true);
    const Layout plain = quantize::describe(format, batch, cols, rows, 1, block, false);
    EXPECT_EQ(transposed.rows, cols);
    EXPECT_EQ(transposed.cols, rows);
    EXPECT_EQ(transposed.scale_cols(), rows / block);
    EXPECT_TRUE(same_bytes(quantize_floats(transposed, x, 0), quantize_floats(plain, x_t, 0)));
  }
}

// One block with NaN, +-Inf, zeros and ordinary values: the non-finite ones take no part in the
// scale and come out as NaN with their sign; amax comes from the rest.
TEST(QuantizeTensor, NonFiniteValuesBecomeNanAndLeaveTheScaleAlone) {
  const float inf = std::numeric_limits<float>::infinity();
  std::vector<float> x(128, 0.0f);
  x[0] = std::nanf("");
  x[1] = -inf;
  x[2] = inf;
  x[3] = 2.0f;  // the amax
  x[4] = -1.0f;
  x[5] = -0.0f;
  x[6] = -std::nanf("");
  const Layout fp8_layout = quantize::describe(Format::kFp8, 1, 1, 128, 1, 128, false);
  const Quantized fp8 = quantize_floats(fp8_layout, x, 0x11);
  EXPECT_EQ(fp8.fp8_scales[0], 2.0f / 448.0f);
  const std::vector<uint8_t> expected = {0x7f, 0xff, 0x7f, 0x7e, fp8::encode_e4m3(-224.0f),
                                         0x80, 0xff, 0x00};
  for (size_t i = 0; i < expected.size(); ++i) EXPECT_EQ(fp8.data[i], expected[i]) << i;

  const Layout mx_layout = quantize::describe(Format::kMxfp8, 1, 1, 128, 1, 32, false);
  const Quantized mx = quantize_floats(mx_layout, x, 0x11);
  EXPECT_EQ(mx.mx_scales[0], 127 - 7);  // 2 <= 448 * 2^-7 (= 3.5), not 2^-8 (1.75)
  EXPECT_EQ(mx.data[3], fp8::encode_e4m3(256.0f));
  EXPECT_EQ(mx.data[4], fp8::encode_e4m3(-128.0f));
  EXPECT_EQ(mx.data[1], 0xff);
  EXPECT_EQ(mx.mx_scales[1], 0);  // the zero blocks: 2^-127, data +-0
  EXPECT_EQ(mx.data[40], 0x00);
}

TEST(QuantizeTensor, ZeroAndSubnormalBlocksUseTheFloor) {
  std::vector<float> x(256, 0.0f);
  x[1] = -0.0f;
  for (int i = 128; i < 256; ++i) x[i] = (i % 3 - 1) * 0x1p-130f;  // amax below the floor
  const Layout layout = quantize::describe(Format::kFp8, 1, 1, 256, 1, 128, false);
  const Quantized q = quantize_floats(layout, x, 0x33);
  EXPECT_EQ(q.fp8_scales[0], 0x1p-116f / 448.0f);
  EXPECT_EQ(q.fp8_scales[1], 0x1p-116f / 448.0f);
  EXPECT_EQ(q.data[0], 0x00);
  EXPECT_EQ(q.data[1], 0x80);
  // +-2^-130 scaled by 448 / 2^-116 (exact): +-448 * 2^-14, in E4M3's subnormal range
  EXPECT_EQ(q.data[128], fp8::encode_e4m3(448.0f * 0x1p-14f));  // 128 % 3 = 2: +2^-130
  EXPECT_EQ(q.data[129], fp8::encode_e4m3(-448.0f * 0x1p-14f));
  EXPECT_EQ(q.data[130], 0x00);
}

TEST(QuantizeTensor, Block128x128CoversPartialRowBlocks) {
  const int64_t rows = 200, cols = 256;
  std::vector<float> x(rows * cols, 1.0f);
  x[150 * cols + 200] = 100.0f;  // amax of block (1, 1)
  x[10 * cols + 5] = -7.0f;      // amax of block (0, 0)
  const Layout layout = quantize::describe(Format::kFp8, 1, rows, cols, 128, 128, false);
  ASSERT_EQ(layout.scale_rows(), 2);
  ASSERT_EQ(layout.scale_cols(), 2);
  const Quantized q = quantize_floats(layout, x, 0x44);
  EXPECT_EQ(q.fp8_scales[0], 7.0f / 448.0f);
  EXPECT_EQ(q.fp8_scales[1], 1.0f / 448.0f);
  EXPECT_EQ(q.fp8_scales[2], 1.0f / 448.0f);
  EXPECT_EQ(q.fp8_scales[3], 100.0f / 448.0f);
  EXPECT_EQ(q.data[150 * cols + 200], 0x7e);
  EXPECT_EQ(q.data[10 * cols + 5], 0xfe);
}

TEST(QuantizeTensor, BadLayoutsNameTheArgument) {
  const auto argument_of = [](auto&& call) {
    try {
      call();
    } catch (const Error& error) {
      return error.argument();
    }
    return std::string("no error");
  };
  EXPECT_EQ(argument_of([] { quantize::describe(Format::kFp8, 1, 4, 100, 1, 128, false); }), "x");
  EXPECT_EQ(argument_of([] { quantize::describe(Format::kMxfp8, 1, 48, 64, 1, 32, true); }), "x");
  EXPECT_EQ(argument_of([] { quantize::describe(Format::kFp8, 1, 4, 128, 1, 32, false); }),
            "block");
  EXPECT_EQ(argument_of([] { quantize::describe(Format::kMxfp8, 1, 4, 128, 1, 128, false); }),
            "block");
  EXPECT_EQ(argument_of([] { quantize::describe(Format::kFp8, 1, 128, 128, 128, 128, true); }),
            "block");
  EXPECT_EQ(argument_of([] { quantize::describe(Format::kMxfp8, 1, 64, 64, 1, 32, true); }),
            "no error");
}

}  // namespace
}  // namespace mok::quantize_test
