// Inputs for the quantizer tests, CPU and GPU: seeded blocks whose magnitudes span the float range,
// with zero blocks, blocks of float subnormals, and special values (+-0, subnormals, +-448 and the
// values around it, +-FLT_MAX, +-Inf, NaNs) scattered among ordinary values.
#pragma once

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "mok/bf16.hpp"

namespace mok::quantize_test {

inline float float_of_bits(uint32_t bits) {
  float value;
  std::memcpy(&value, &bits, sizeof(value));
  return value;
}

inline uint32_t bits_of(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  return bits;
}

inline std::vector<float> special_values() {
  const float inf = std::numeric_limits<float>::infinity();
  const std::vector<float> magnitudes = {0.0f,      FLT_TRUE_MIN, float_of_bits(0x007fffffu),
                                         FLT_MIN,   0x1p-10f,     0x1p-9f,
                                         0x1.8p-9f, 0x1p-6f,      0.5f,
                                         1.0f,      1.75f,        448.0f,
                                         456.0f,    464.0f,       465.0f,
                                         480.0f,    1e30f,        FLT_MAX,
                                         inf};
  std::vector<float> values;
  for (float magnitude : magnitudes) {
    values.push_back(magnitude);
    values.push_back(-magnitude);
  }
  values.push_back(float_of_bits(0x7fc00000u));  // quiet NaN
  values.push_back(float_of_bits(0xffc00000u));  // negative quiet NaN
  values.push_back(float_of_bits(0x7f800001u));  // signalling NaN payload
  return values;
}

// `count` values in blocks of `block` consecutive elements: each block is scaled by its own power
// of two in [2^-140, 2^120]; 1 in 16 blocks is zero (either sign), 1 in 16 holds float subnormals
// only, and 1 % of the elements of the rest are special values.
inline std::vector<float> random_values(size_t count, size_t block, uint32_t seed) {
  std::mt19937 generator(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int> exponent(-140, 120);
  std::uniform_int_distribution<int> kind(0, 15);
  std::uniform_real_distribution<float> uniform(0.0f, 1.0f);
  const std::vector<float> specials = special_values();
  std::uniform_int_distribution<size_t> pick(0, specials.size() - 1);
  std::vector<float> values(count);
  for (size_t begin = 0; begin < count; begin += block) {
    const size_t end = std::min(count, begin + block);
    const int block_kind = kind(generator);
    const float scale = std::ldexp(1.0f, exponent(generator));
    for (size_t i = begin; i < end; ++i) {
      if (block_kind == 0) {
        values[i] = uniform(generator) < 0.5f ? 0.0f : -0.0f;
      } else if (block_kind == 1) {
        values[i] = normal(generator) * 0x1p-140f;  // float subnormals
      } else if (uniform(generator) < 0.01f) {
        values[i] = specials[pick(generator)];
      } else {
        values[i] = normal(generator) * scale;
      }
    }
  }
  return values;
}

inline std::vector<bf16> to_bf16(const std::vector<float>& values) {
  std::vector<bf16> out(values.size());
  for (size_t i = 0; i < values.size(); ++i) out[i] = bf16(values[i]);
  return out;
}

}  // namespace mok::quantize_test
