// bf16 storage type for host code, bit-exact with the GPU's __nv_bfloat16:
// float -> bf16 rounds to nearest even, NaN stays NaN (quiet), bf16 -> float is exact.
#pragma once

#include <cstdint>
#include <cstring>

namespace mok {

struct bf16 {
  uint16_t bits = 0;

  bf16() = default;
  explicit bf16(float value) : bits(round_bits(value)) {}

  static bf16 from_bits(uint16_t raw) {
    bf16 result;
    result.bits = raw;
    return result;
  }

  explicit operator float() const { return to_float(); }

  float to_float() const {
    const uint32_t widened = static_cast<uint32_t>(bits) << 16;
    float value;
    std::memcpy(&value, &widened, sizeof(value));
    return value;
  }

  static uint16_t round_bits(float value) {
    uint32_t raw;
    std::memcpy(&raw, &value, sizeof(raw));
    if ((raw & 0x7fffffffu) > 0x7f800000u) {  // NaN: keep the sign, make it quiet
      return static_cast<uint16_t>((raw >> 16) | 0x0040u);
    }
    const uint32_t rounding_bias = 0x7fffu + ((raw >> 16) & 1u);
    return static_cast<uint16_t>((raw + rounding_bias) >> 16);
  }
};

static_assert(sizeof(bf16) == 2, "bf16 must be two bytes, as on the GPU");

// The float a bf16 store followed by a load gives back: the one rounding point of every bf16
// tensor.
inline float round_to_bf16(float value) { return bf16(value).to_float(); }

}  // namespace mok
