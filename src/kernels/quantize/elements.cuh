// What every quantize kernel does per element: 16-byte input vectors widened to floats, block
// maxima across the lanes of a block, and the scaled E4M3 encoding (the hardware conversion with
// encode_e4m3's rule for NaN and +-Inf), four codes to a 32-bit word.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/ptx/fp8.cuh"
#include "kernels/ptx/math.cuh"
#include "mok/detail/fp8_numerics.hpp"
#include "mok/quantize.hpp"

namespace mok::quantize {

// Inputs by their storage type: bf16 as its 16-bit pattern, fp32 as float.
template <class Input>
struct InputVector;

template <>
struct InputVector<uint16_t> {
  static constexpr int kElements = 8;  // per 16 bytes
  using Raw = uint4;                   // the 16 bytes as loaded
  __device__ __forceinline__ static void load(const uint16_t* address, float (&values)[8]) {
    widen(*reinterpret_cast<const uint4*>(address), values);
  }
  __device__ __forceinline__ static Raw load_raw(const uint16_t* address) {
    return *reinterpret_cast<const uint4*>(address);
  }
  // 16 bytes of bf16 as floats (exact).
  __device__ __forceinline__ static void widen(const uint4& raw, float (&values)[8]) {
    const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      values[2 * i] = __uint_as_float(words[i] << 16);
      values[2 * i + 1] = __uint_as_float(words[i] & 0xffff0000u);
    }
  }
  __device__ __forceinline__ static float load_one(const uint16_t* address) {
    return __uint_as_float(static_cast<uint32_t>(*address) << 16);
  }
};

template <>
struct InputVector<float> {
  static constexpr int kElements = 4;
  using Raw = float4;
  __device__ __forceinline__ static void load(const float* address, float (&values)[4]) {
    widen(*reinterpret_cast<const float4*>(address), values);
  }
  __device__ __forceinline__ static Raw load_raw(const float* address) {
    return *reinterpret_cast<const float4*>(address);
  }
  __device__ __forceinline__ static void widen(const float4& raw, float (&values)[4]) {
    values[0] = raw.x;
    values[1] = raw.y;
    values[2] = raw.z;
    values[3] = raw.w;
  }
  __device__ __forceinline__ static float load_one(const float* address) { return *address; }
};

// Element `part` of a word holding one fp32 or two bf16 inputs (the lower address in the low half),
// as a float (exact).
template <class Input>
__device__ __forceinline__ float staged_element(uint32_t word, int part) {
  if constexpr (sizeof(Input) == 2) {
    return __uint_as_float(part == 0 ? word << 16 : word & 0xffff0000u);
  } else {
    return __uint_as_float(word);
  }
}

// The largest finite magnitude of `values`, as float bits (fp8::finite_magnitude_bits).
template <int N>
__device__ __forceinline__ uint32_t finite_amax_bits(const float (&values)[N]) {
  uint32_t amax_bits = 0;
#pragma unroll
  for (int i = 0; i < N; ++i) amax_bits = max(amax_bits, fp8::finite_magnitude_bits(values[i]));
  return amax_bits;
}

// The largest magnitude's bits of N floats, NaN and +-Inf included (their bits order above every
// finite magnitude's): below fp8::kFloatExponentMask exactly when every value is finite, and
// then equal to finite_amax_bits, without its test and select per value.
template <int N>
__device__ __forceinline__ uint32_t magnitude_max_bits(const float (&values)[N]) {
  uint32_t bits = 0;
#pragma unroll
  for (int i = 0; i < N; ++i)
    bits = max(bits, __float_as_uint(values[i]) & fp8::kFloatMagnitudeMask);
  return bits;
}

// The largest magnitude of bf16 values packed two to a word, as float bits, and whether every
// one of them is finite; when one is not, finite_amax_bits of the widened values is the answer.
// A bf16 magnitude's bits order as its value does, so two 16-bit maxima a word replace the
// widen, the mask, the finiteness test and the maximum of each value.
inline constexpr uint32_t kBf16InfBits = 0x7f80u;  // bf16 +Inf; magnitudes above it are NaNs

// The running maxima of the magnitudes of a word's two bf16 halves, each in its own half.
__device__ __forceinline__ uint32_t max_bf16_magnitudes(uint32_t halves, uint32_t word) {
  return ptx::max_u16x2(halves, word & 0x7fff7fffu);
}

template <int kWords>
__device__ __forceinline__ uint32_t packed_bf16_amax_bits(const uint32_t (&words)[kWords],
                                                          bool& finite) {
  uint32_t halves = 0;
#pragma unroll
  for (int w = 0; w < kWords; ++w) halves = max_bf16_magnitudes(halves, words[w]);
  const uint32_t magnitude = max(halves >> 16, halves & 0xffffu);
  finite = magnitude < kBf16InfBits;
  return magnitude << 16;
}

// A 16-byte input vector's finite_amax_bits, and whether all its values are finite: for bf16
// from the packed pairs (the general way only when one is not); fp32 is not looked at (false).
__device__ __forceinline__ uint32_t vector_amax_bits(const uint4& raw, const float (&values)[8],
                                                     bool& finite) {
  const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
  const uint32_t bits = packed_bf16_amax_bits(words, finite);
  return finite ? bits : finite_amax_bits(values);
}
__device__ __forceinline__ uint32_t vector_amax_bits(const float4& /*raw*/,
                                                     const float (&values)[4], bool& finite) {
  finite = false;
  return finite_amax_bits(values);
}

// The maximum over the `kLanes` consecutive lanes (a power of two, aligned) this lane belongs to.
template <int kLanes>
__device__ __forceinline__ uint32_t lanes_max(uint32_t value) {
#pragma unroll
  for (int offset = kLanes / 2; offset > 0; offset /= 2) {
    value = max(value, __shfl_xor_sync(0xffffffffu, value, offset));
  }
  return value;
}

// The maximum over the CTA's kWarps warps, in every thread: each warp's maximum through
// warp_bits (kWarps words of shared memory), with one barrier.
template <int kWarps>
__device__ __forceinline__ uint32_t cta_max(uint32_t value, uint32_t* warp_bits) {
  value = lanes_max<32>(value);
  if (threadIdx.x % 32 == 0) warp_bits[threadIdx.x / 32] = value;
  __syncthreads();
#pragma unroll
  for (int warp = 0; warp < kWarps; ++warp) value = max(value, warp_bits[warp]);
  return value;
}

// What a block's elements are multiplied by, from the block's amax; the scale itself is stored by
// store_scale.
template <Format kFormat>
__device__ __forceinline__ float block_inverse(float amax) {
  if constexpr (kFormat == Format::kFp8) {
    return fp8::fp8_block_scale(amax).inverse;
  } else {
    return fp8::e8m0_inverse(fp8::e8m0_scale_code(amax));
  }
}

template <Format kFormat>
__device__ __forceinline__ void store_scale(void* scales, int64_t index, float amax) {
  if constexpr (kFormat == Format::kFp8) {
    static_cast<float*>(scales)[index] = fp8::fp8_block_scale(amax).scale;
  } else {
    static_cast<uint8_t*>(scales)[index] = fp8::e8m0_scale_code(amax);
  }
}

// values[i] * inverse as E4M3, value i in byte i % 4 of word i / 4 (little-endian: the bytes in
// memory order), for values known to be finite: the hardware rounds and saturates as
// fp8::encode_e4m3(mul_rn(values[i], inverse)) does, and |x| <= amax keeps |x * inverse| near 448.
template <int N>
__device__ __forceinline__ void encode_scaled_finite(const float (&values)[N], float inverse,
                                                     uint32_t (&words)[N / 4]) {
  static_assert(N % 4 == 0, "whole 32-bit words of codes");
#pragma unroll
  for (int w = 0; w < N / 4; ++w) {
    float scaled[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) scaled[j] = __fmul_rn(values[4 * w + j], inverse);
    words[w] = static_cast<uint32_t>(ptx::cvt_e4m3x2(scaled[0], scaled[1])) |
               (static_cast<uint32_t>(ptx::cvt_e4m3x2(scaled[2], scaled[3])) << 16);
  }
}

// encode_scaled, or encode_scaled_finite when every value is known to be finite (the same bytes).
template <int N>
__device__ __forceinline__ void encode_scaled(const float (&values)[N], float inverse,
                                              bool all_finite, uint32_t (&words)[N / 4]);

// The same for any floats: equal to fp8::encode_e4m3(mul_rn(values[i], inverse)) for every float
// (checked exhaustively by tests/gpu/test_quantize.cu): NaN or +-Inf inputs (which the hardware
// would turn into NaN and +-448) are patched to sign | 0x7f.
template <int N>
__device__ __forceinline__ void encode_scaled(const float (&values)[N], float inverse,
                                              uint32_t (&words)[N / 4]) {
  encode_scaled_finite(values, inverse, words);
#pragma unroll
  for (int i = 0; i < N; ++i) {
    const uint32_t bits = __float_as_uint(values[i]);
    if ((bits & fp8::kFloatExponentMask) == fp8::kFloatExponentMask) {
      const uint32_t code = ((bits >> 24) & fp8::kSignBit) | fp8::kE4M3NanCode;
      const int shift = 8 * (i % 4);
      words[i / 4] = (words[i / 4] & ~(0xffu << shift)) | (code << shift);
    }
  }
}

template <int N>
__device__ __forceinline__ void encode_scaled(const float (&values)[N], float inverse,
                                              bool all_finite, uint32_t (&words)[N / 4]) {
  if (all_finite) {
    encode_scaled_finite(values, inverse, words);
  } else {
    encode_scaled(values, inverse, words);
  }
}

// N codes (4 per word) to `address`, which is aligned to N bytes.
template <int N>
__device__ __forceinline__ void store_codes(uint8_t* address, const uint32_t (&words)[N / 4]) {
  if constexpr (N == 4) {
    *reinterpret_cast<uint32_t*>(address) = words[0];
  } else if constexpr (N == 8) {
    *reinterpret_cast<uint2*>(address) = make_uint2(words[0], words[1]);
  } else {
    static_assert(N % 16 == 0, "4, 8 or a multiple of 16 codes");
#pragma unroll
    for (int i = 0; i < N / 16; ++i) {
      reinterpret_cast<uint4*>(address)[i] =
          make_uint4(words[4 * i], words[4 * i + 1], words[4 * i + 2], words[4 * i + 3]);
    }
  }
}

}  // namespace mok::quantize
