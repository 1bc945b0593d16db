// What the tests of the FP8 grouped dgrad and wgrad GEMMs (test_gemm_fp8_dgrad.cu,
// test_gemm_fp8_wgrad.cu) share. As in test_gemm_fp8.cu, two kinds of data:
//  - exact: E4M3 integers in [-4, 4], power-of-two scales; every block sum and promoted sum is
//    exact in fp32, so fp32 outputs equal the oracle bit for bit, bf16 the oracle rounded once.
//  - random: bf16 values of magnitudes varying by 2^8, quantized by mok::quantize::quantize_cpu,
//    within kBlockSumTolerance · S of the oracle (the bound test_gemm_fp8.cu derives), and, against
//    fp64 on the bf16 inputs themselves, compared with a rowwise (torch-style) quantization of
//    the same inputs summed exactly in fp64: rms no larger, max within kRowwiseFactor of it.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "mok/bf16.hpp"
#include "mok/detail/fp8_numerics.hpp"

namespace mok::gemm_test {

inline constexpr int kBlock = 128;
inline constexpr double kBlockSumTolerance = 0x1p-10;  // test_gemm_fp8.cu derives it
inline constexpr uint8_t kE4m3Nan = 0x7f;
// Against fp64 on the bf16 inputs, relative to S = sum |a b|, both recipes are dominated by the
// E4M3 rounding of the largest blocks, which they scale alike (a row's amax is its largest block's
// amax), so their errors come out within a percent of each other and the larger of two maxima
// over all elements is a coin toss; the finer blocks show in the rms. The max is held to a small
// factor of the rowwise one (STYLE.md's rule for a same-precision implementation).
inline constexpr double kRowwiseFactor = 2.0;

inline std::vector<double> decode_all(const std::vector<uint8_t>& codes) {
  std::vector<double> values(codes.size());
  for (size_t i = 0; i < codes.size(); ++i) values[i] = fp8::decode_e4m3(codes[i]);
  return values;
}

// bf16-rounded normal values whose magnitude varies by 2^8 with (row / row_period + 3 · (column /
// 128)): with row_period 128 the magnitude is constant inside each 128 x 128 square and varies
// between squares, so along either dimension the blocks of a row (or column) differ in size —
// the case blockwise scaling is for (outlier tokens, features).
inline std::vector<float> random_values(int rows, int cols, uint32_t seed, float scale,
                                        int row_period) {
  std::mt19937 generator(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> values(static_cast<size_t>(rows) * cols);
  for (size_t i = 0; i < values.size(); ++i) {
    const int row = static_cast<int>(i / cols), column = static_cast<int>(i % cols);
    const int exponent = (row / row_period + 3 * (column / kBlock)) % 9 - 4;
    values[i] = bf16(scale * normal(generator) * std::ldexp(1.0f, exponent)).to_float();
  }
  return values;
}

// The error of results against fp64 on the unquantized inputs, relative to S = sum |a b|.
struct InputError {
  double max = 0.0, sum_squares = 0.0;
  size_t count = 0;
  void add(double value, double exact, double magnitude) {
    const double error = std::abs(value - exact) / std::max(magnitude, 1e-300);
    max = std::max(max, error);
    sum_squares += error * error;
    ++count;
  }
  double rms() const { return std::sqrt(sum_squares / std::max<size_t>(count, 1)); }
};

}  // namespace mok::gemm_test
