// Arithmetic the compiler does not emit on its own: approximations, and packed 16-bit integers.
#pragma once

#include <cstdint>

namespace mok::ptx {

// The larger of each unsigned 16-bit half of a and b, in one instruction (sm_90).
__device__ __forceinline__ uint32_t max_u16x2(uint32_t a, uint32_t b) {
  uint32_t larger;
  asm("max.u16x2 %0, %1, %2;" : "=r"(larger) : "r"(a), "r"(b));
  return larger;
}

// The hardware's approximate reciprocal, denormals flushed (callers refine it; see
// gemm/swiglu.cuh's reciprocal_rn).
__device__ __forceinline__ float reciprocal_approximate(float value) {
  float approximate;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(approximate) : "f"(value));
  return approximate;
}

}  // namespace mok::ptx
