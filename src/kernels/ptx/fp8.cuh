// FP8 conversions the compiler has no intrinsic name for in mok's style.
#pragma once

#include <cuda_fp16.h>

#include <cstdint>

namespace mok::ptx {

// Two floats to two E4M3 (fn) codes, packed: `low` in bits 0..7, `high` in bits 8..15. Rounds to
// nearest, ties to even, subnormals included; .satfinite (mandatory for this conversion) turns
// finite magnitudes above 448 and +-Inf into +-448, NaN into NaN. Callers that want another rule
// for non-finite inputs patch those lanes (quantize/elements.cuh).
__device__ __forceinline__ uint16_t cvt_e4m3x2(float low, float high) {
  uint16_t packed;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(packed) : "f"(high), "f"(low));
  return packed;
}

// An E4M3 (fn) code (bits 0..7 of `code`) as a float, exact: every E4M3 value is an fp16 value
// (the NaN codes give NaN).
__device__ __forceinline__ float e4m3_to_float(uint32_t code) {
  uint32_t halves;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(halves) : "h"(static_cast<uint16_t>(code & 0xffu)));
  return __half2float(__ushort_as_half(static_cast<unsigned short>(halves & 0xffffu)));
}

}  // namespace mok::ptx
