// fp8::mx_round_trip, the element the mxfp8 layer feeds the bf16 GEMMs on the GPU, against the
// quantizers' definition: with the E8M0 code of its 1 x 32 block's amax it gives
// dequantize_cpu(quantize_cpu(x)) bit for bit (random blocks over the whole float range, every
// bf16 value, zeros, subnormals, NaN, +-Inf), and the value it gives is exact in bf16 from 2^-130
// up (its documented exception lies below), so writing it as bf16 loses nothing.
#include <gtest/gtest.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "mok/bf16.hpp"
#include "mok/detail/fp8_numerics.hpp"
#include "mok/quantize.hpp"
#include "quantize_cases.hpp"

namespace mok::quantize_test {
namespace {

constexpr int kBlock = 32;
constexpr int kCols = 256;  // 8 blocks a row

// What the quantizers give for `x` (rows of kCols values, row-major, in 1 x 32 blocks): the E8M0
// codes and the dequantized values.
struct Dequantized {
  std::vector<uint8_t> codes;
  std::vector<float> values;
};

Dequantized dequantize_blocks(const std::vector<float>& x) {
  const int64_t rows = static_cast<int64_t>(x.size()) / kCols;
  const quantize::Layout layout =
      quantize::describe(quantize::Format::kMxfp8, 1, rows, kCols, 1, kBlock, false);
  std::vector<uint8_t> data(static_cast<size_t>(layout.num_elements()), 0x5a);
  Dequantized out{std::vector<uint8_t>(static_cast<size_t>(layout.num_scales()), 0x5a),
                  std::vector<float>(x.size())};
  quantize::quantize_cpu(layout, x.data(), quantize::InputType::kFp32, data.data(),
                         out.codes.data());
  quantize::dequantize_cpu(layout, data.data(), out.codes.data(), out.values.data());
  return out;
}

// The E8M0 code of x[begin, begin + 32) from its largest finite magnitude.
uint8_t block_code(const std::vector<float>& x, size_t begin) {
  uint32_t amax_bits = 0;
  for (size_t i = begin; i < begin + kBlock; ++i) {
    amax_bits = std::max(amax_bits, fp8::finite_magnitude_bits(x[i]));
  }
  return fp8::e8m0_scale_code(float_of_bits(amax_bits));
}

// mx_round_trip of every element of x against the quantizers' value, bit for bit (NaN too: both
// take decode_e4m3's NaN times the scale). Returns the round-tripped values.
std::vector<float> expect_round_trip_matches(const std::vector<float>& x) {
  const Dequantized expected = dequantize_blocks(x);
  std::vector<float> got(x.size());
  int64_t mismatches = 0;
  for (size_t begin = 0; begin < x.size(); begin += kBlock) {
    const uint8_t code = block_code(x, begin);
    EXPECT_EQ(code, expected.codes[begin / kBlock]) << "block " << begin / kBlock;
    for (size_t i = begin; i < begin + kBlock; ++i) {
      got[i] = fp8::mx_round_trip(x[i], code);
      if (bits_of(got[i]) != bits_of(expected.values[i]) && ++mismatches <= 5) {
        ADD_FAILURE() << "element " << i << ": input bits 0x" << std::hex << bits_of(x[i])
                      << ", code " << std::dec << int(code) << ": mx_round_trip bits 0x" << std::hex
                      << bits_of(got[i]) << ", dequantized 0x" << bits_of(expected.values[i]);
      }
    }
  }
  EXPECT_EQ(mismatches, 0) << "of " << x.size();
  return got;
}

bool exact_in_bf16(float value) { return bits_of(round_to_bf16(value)) == bits_of(value); }

// Every finite round-tripped value of magnitude 2^-130 or more (and every zero and infinity) is a
// bf16 value. Returns how many values it checked.
int64_t expect_exact_in_bf16(const std::vector<float>& values) {
  int64_t checked = 0, failures = 0;
  for (size_t i = 0; i < values.size(); ++i) {
    const float value = values[i];
    if (std::isnan(value) || (value != 0 && std::fabs(value) < 0x1p-130f)) continue;
    ++checked;
    if (!exact_in_bf16(value) && ++failures <= 5) {
      ADD_FAILURE() << "element " << i << ": " << value << " (bits 0x" << std::hex << bits_of(value)
                    << ") is not a bf16 value";
    }
  }
  EXPECT_EQ(failures, 0) << "of " << checked;
  return checked;
}

TEST(MxRoundTrip, MatchesTheQuantizersOnRandomBlocks) {
  // Blocks of 32 with one magnitude each, and 48-element runs that give a block two magnitudes
  // (its small values then fall to E4M3 subnormals or zero); both from 2^-140 to 2^120, with zero
  // blocks, float-subnormal blocks and 1 % special values.
  for (size_t run : {size_t{32}, size_t{48}}) {
    SCOPED_TRACE("runs of " + std::to_string(run));
    const std::vector<float> x = random_values(512 * kCols, run, static_cast<uint32_t>(run));
    int64_t nans = 0, infinities = 0, subnormals = 0, zeros = 0;
    for (const float value : x) {
      nans += std::isnan(value);
      infinities += std::isinf(value);
      subnormals += std::fpclassify(value) == FP_SUBNORMAL;
      zeros += value == 0;
    }
    // (the cases this test is about are present)
    EXPECT_GT(nans, 0);
    EXPECT_GT(infinities, 0);
    EXPECT_GT(subnormals, 1000);
    EXPECT_GT(zeros, 1000);
    expect_round_trip_matches(x);
    // bf16 inputs (mx_rows on bf16 rows): the same rule
    std::vector<float> widened(x.size());
    for (size_t i = 0; i < x.size(); ++i) widened[i] = round_to_bf16(x[i]);
    expect_round_trip_matches(widened);
  }
}

// Every bf16 bit pattern, twice: in order (a block holds 32 neighbouring patterns: one exponent,
// each value near the block's amax), and shuffled (blocks of unrelated magnitudes).
TEST(MxRoundTrip, MatchesTheQuantizersOnEveryBf16) {
  std::vector<uint32_t> patterns(1u << 16);
  std::iota(patterns.begin(), patterns.end(), 0u);
  for (const bool shuffled : {false, true}) {
    SCOPED_TRACE(shuffled ? "shuffled" : "in order");
    if (shuffled) std::shuffle(patterns.begin(), patterns.end(), std::mt19937(23));
    std::vector<float> x(patterns.size());
    for (size_t i = 0; i < x.size(); ++i) x[i] = float_of_bits(patterns[i] << 16);
    const std::vector<float> round_tripped = expect_round_trip_matches(x);
    EXPECT_GT(expect_exact_in_bf16(round_tripped), 30000);
  }
}

// NaN, +-Inf, +-0, float subnormals and ordinary values in one block: the non-finite values leave
// the scale to the rest and come back NaN with their sign; zeros keep their sign.
TEST(MxRoundTrip, SpecialValuesInOneBlock) {
  const float inf = std::numeric_limits<float>::infinity();
  std::vector<float> x(kCols, 0.0f);
  const std::vector<float> specials = {std::nanf(""), -std::nanf(""), inf,  -inf,  -0.0f,
                                       FLT_TRUE_MIN,  -0x1p-140f,     3.0f, -1.0f, 0x1p-9f};
  std::copy(specials.begin(), specials.end(), x.begin());
  // Block 1: non-finite values only (amax 0: code 0); block 2: float subnormals only; block 3:
  // FLT_MAX (the product passes it: Inf, as the quantizers' note says); block 4: -0 only.
  x[32] = inf, x[33] = std::nanf(""), x[34] = -inf;
  for (int i = 64; i < 96; ++i)
    x[i] = (i % 2 ? -1.0f : 1.0f) * FLT_TRUE_MIN * static_cast<float>(i);
  x[96] = FLT_MAX, x[97] = -1.0f;
  for (int i = 128; i < 160; ++i) x[i] = -0.0f;
  const std::vector<float> got = expect_round_trip_matches(x);
  EXPECT_EQ(block_code(x, 0), 127 - 7);  // amax 3 <= 448 * 2^-7
  for (int i = 0; i < 4; ++i) {
    EXPECT_TRUE(std::isnan(got[i])) << i;
    EXPECT_EQ(std::signbit(got[i]), std::signbit(x[i])) << i;
  }
  EXPECT_EQ(bits_of(got[4]), bits_of(-0.0f));
  EXPECT_EQ(bits_of(got[5]), 0u);  // 2^-149 * 2^7: below E4M3's half step, to +0
  EXPECT_EQ(bits_of(got[6]), bits_of(-0.0f));
  EXPECT_EQ(got[7], 3.0f);
  EXPECT_EQ(got[8], -1.0f);
  EXPECT_EQ(got[9], 0x1p-9f);  // 2^-2 after scaling: an E4M3 value
  EXPECT_EQ(block_code(x, 32), 0);
  EXPECT_TRUE(std::isnan(got[32]) && std::isnan(got[33]) && std::isnan(got[34]));
  EXPECT_EQ(got[35], 0.0f);
  EXPECT_TRUE(std::isinf(got[96]));
  for (int i = 128; i < 160; ++i) EXPECT_EQ(bits_of(got[i]), bits_of(-0.0f)) << i;
}

// The values the GPU writes as bf16: exact from 2^-130 up over the random data's every magnitude,
// so every value of a block with code 3 or more (scale 2^-124 up: amax above 448 * 2^-125, about
// 2^-116.2) is exact; and the exception is real: a block of code 2 (amax 2^-117) holds 2^-134.
TEST(MxRoundTrip, IsExactInBf16FromTwoToTheMinus130) {
  const std::vector<float> x = random_values(1024 * kCols, 32, 29);
  const std::vector<float> got = expect_round_trip_matches(x);
  EXPECT_GT(expect_exact_in_bf16(got), static_cast<int64_t>(x.size() / 2));
  int64_t normal_blocks = 0;
  for (size_t begin = 0; begin < x.size(); begin += kBlock) {
    if (block_code(x, begin) < 3) continue;
    ++normal_blocks;
    for (size_t i = begin; i < begin + kBlock; ++i) {
      if (!std::isnan(got[i])) ASSERT_TRUE(exact_in_bf16(got[i])) << "element " << i;
    }
  }
  EXPECT_GT(normal_blocks, 1000);
  // Scale 2^-125: E4M3's subnormal step 2^-9 becomes 2^-134, below bf16's smallest subnormal.
  std::vector<float> tiny(kCols, 0.0f);
  tiny[0] = 0x1p-117f;
  tiny[1] = 0x1p-134f;
  const std::vector<float> tiny_got = expect_round_trip_matches(tiny);
  EXPECT_EQ(block_code(tiny, 0), 2);
  EXPECT_EQ(tiny_got[1], 0x1p-134f);
  EXPECT_FALSE(exact_in_bf16(tiny_got[1]));
}

}  // namespace
}  // namespace mok::quantize_test
