// The scalars of mok's two FP8 formats, one definition for the CPU quantizers and the GPU kernels:
// the E4M3 element code, block maxima, and the two kinds of block scale. The GPU kernels convert
// elements with the hardware instruction (ptx/fp8.cuh) instead of encode_e4m3; tests/gpu checks
// the two agree on every float. docs/quantize.md states the rules in prose.
//
// E4M3 here is the "fn" variant (OCP FP8 E4M3, torch.float8_e4m3fn): bias 7, no infinities, the
// codes S.1111.111 (0x7f, 0xff) are NaN, the largest finite magnitude is 448 (0x7e), subnormals
// are m * 2^-9 for m = 1..7.
#pragma once

#include <cstdint>

#include "mok/detail/numerics.hpp"

namespace mok::fp8 {

inline constexpr float kE4M3Max = 448.0f;
inline constexpr uint32_t kE4M3MaxBits = 0x43e00000u;  // 448.0f
inline constexpr uint8_t kE4M3MaxCode = 0x7e;
inline constexpr uint8_t kE4M3NanCode = 0x7f;  // with the sign bit 0x80 for a negative input
inline constexpr uint8_t kSignBit = 0x80;
inline constexpr uint32_t kFloatExponentMask = 0x7f800000u;
inline constexpr uint32_t kFloatMagnitudeMask = 0x7fffffffu;

// fp8 (fp32 scale) blocks: amax is raised to this floor before the scale is taken, so that both
// amax / 448 and 448 / amax are normal floats (2^-124.8 and 1.75 * 2^124). A zero block, and a
// block of magnitudes all below 2^-116, get scale 2^-116 / 448.
inline constexpr float kFp8MinAmax = 0x1p-116f;

// E8M0 (OCP MX scale): 2^(code - 127) for codes 0..254; 255 is NaN.
inline constexpr uint8_t kE8M0NanCode = 0xff;
inline constexpr int kE8M0Bias = 127;

MOK_HOST_DEVICE uint32_t float_to_bits(float value) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(value);
#else
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  return bits;
#endif
}

// |x| as float bits when x is finite, 0 for NaN and +-Inf: block maxima skip non-finite values,
// and the maximum of non-negative floats is the integer maximum of their bits (exact, no NaN
// rules to agree on).
MOK_HOST_DEVICE uint32_t finite_magnitude_bits(float value) {
  const uint32_t magnitude = float_to_bits(value) & kFloatMagnitudeMask;
  return magnitude < kFloatExponentMask ? magnitude : 0u;
}

// x -> E4M3, rounding to nearest, ties to even. Finite magnitudes above 448 saturate to +-448
// (none arise from a quantizer: its scaled values stay within 448). NaN and +-Inf (which E4M3 fn
// cannot hold) give NaN with the input's sign: 0x7f or 0xff. Zeros and values that round to zero
// keep their sign (0x00 / 0x80).
MOK_HOST_DEVICE uint8_t encode_e4m3(float value) {
  const uint32_t bits = float_to_bits(value);
  const uint8_t sign = static_cast<uint8_t>((bits >> 24) & kSignBit);
  const uint32_t magnitude = bits & kFloatMagnitudeMask;
  if (magnitude >= kFloatExponentMask) return sign | kE4M3NanCode;
  if (magnitude >= kE4M3MaxBits) return sign | kE4M3MaxCode;
  const int exponent = static_cast<int>(magnitude >> 23) - 127;  // -127 for float subnormals
  const uint32_t significand = (magnitude & 0x007fffffu) | 0x00800000u;
  // The value is significand * 2^(exponent - 23). One E4M3 step is 2^(exponent - 3) in the normal
  // range (exponent >= -6) and 2^-9 below it, so the code counts steps of significand >> shift
  // above the range's base code; a carry out of the mantissa moves into the exponent by itself.
  const bool normal = exponent >= -6;
  const int shift = normal ? 20 : 14 - exponent;
  if (shift >= 25) return sign;  // below 2^-10: rounds to zero (float subnormals too)
  const uint32_t kept = significand >> shift;
  const uint32_t rest = significand & ((1u << shift) - 1u);
  const uint32_t half = 1u << (shift - 1);
  const uint32_t rounded = kept + ((rest > half || (rest == half && (kept & 1u))) ? 1u : 0u);
  const uint32_t base = normal ? static_cast<uint32_t>(exponent + 6) << 3 : 0u;
  return sign | static_cast<uint8_t>(base + rounded);
}

// E4M3 -> float, exact; the NaN codes give a quiet NaN with the code's sign.
MOK_HOST_DEVICE float decode_e4m3(uint8_t code) {
  const uint32_t sign = static_cast<uint32_t>(code & kSignBit) << 24;
  const uint32_t exponent = (code >> 3) & 0xfu;
  const uint32_t mantissa = code & 0x7u;
  if (exponent == 0xfu && mantissa == 0x7u) return numerics::bits_to_float(sign | 0x7fc00000u);
  if (exponent == 0u) {
    // m * 2^-9: exact in float; the sign goes on by bits so that 0x80 decodes to -0.
    const float magnitude = numerics::mul_rn(static_cast<float>(mantissa), 0x1p-9f);
    return numerics::bits_to_float(sign | float_to_bits(magnitude));
  }
  return numerics::bits_to_float(sign | ((exponent - 7u + 127u) << 23) | (mantissa << 20));
}

// ---- fp8: fp32 scale per block ------------------------------------------------------------------

struct Fp8BlockScale {
  float scale;    // stored: x ~ decode(q) * scale
  float inverse;  // q = encode(x * inverse)
};

// amax: the block's largest finite magnitude (0 when it has none). scale = amax' / 448 and
// inverse = 448 / amax', each one correctly rounded division, with amax' = max(amax, 2^-116).
MOK_HOST_DEVICE Fp8BlockScale fp8_block_scale(float amax) {
  const float clamped = numerics::max_of(amax, kFp8MinAmax);
  return {numerics::div_rn(clamped, kE4M3Max), numerics::div_rn(kE4M3Max, clamped)};
}

// ---- mxfp8: E8M0 scale per block ----------------------------------------------------------------

// The smallest power of two 2^s with amax <= 448 * 2^s, as its E8M0 code s + 127, computed exactly
// from amax's bits (no rounded division): amax = m * 2^E, m in [1, 2), needs s = E - 8 when
// m <= 1.75 and s = E - 7 when m > 1.75 (448 = 1.75 * 2^8). Codes below 0 become 0 (2^-127, which
// still bounds every tiny or zero block); a finite amax never needs more than 247.
MOK_HOST_DEVICE uint8_t e8m0_scale_code(float amax) {
  const uint32_t magnitude = float_to_bits(amax) & kFloatMagnitudeMask;
  const int biased_exponent = static_cast<int>(magnitude >> 23);
  const int code = biased_exponent - 8 + ((magnitude & 0x007fffffu) > 0x00600000u ? 1 : 0);
  return static_cast<uint8_t>(code < 0 ? 0 : code);
}

// 2^(code - 127) as a float (2^-127 is the subnormal 0x00400000); NaN for 255.
MOK_HOST_DEVICE float e8m0_to_float(uint8_t code) {
  if (code == kE8M0NanCode) return numerics::bits_to_float(0x7fc00000u);
  if (code == 0) return numerics::bits_to_float(0x00400000u);
  return numerics::bits_to_float(static_cast<uint32_t>(code) << 23);
}

// 2^(127 - code), the factor the elements are multiplied by (exact, a power of two): a normal float
// for every code up to 253, 2^-127 for 254.
MOK_HOST_DEVICE float e8m0_inverse(uint8_t code) {
  if (code >= 254) return numerics::bits_to_float(0x00400000u);
  return numerics::bits_to_float(static_cast<uint32_t>(254 - code) << 23);
}

// mxfp8's quantize-then-dequantize of one value of a block whose E8M0 code is `code`:
// decode_e4m3(encode_e4m3(value * 2^-s)) * 2^s, the value the reference's block GEMM multiplies
// (dequantize_cpu's element). It is exact in bf16 unless it lies below 2^-130 (only in a block
// whose E8M0 code is 2 or less: amax at most 448 * 2^-125): the mxfp8 layer on the GPU feeds the
// bf16 GEMMs these values.
MOK_HOST_DEVICE float mx_round_trip(float value, uint8_t code) {
  const uint8_t element = encode_e4m3(numerics::mul_rn(value, e8m0_inverse(code)));
  return numerics::mul_rn(decode_e4m3(element), e8m0_to_float(code));
}

}  // namespace mok::fp8
