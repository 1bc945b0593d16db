// Approximate arithmetic the compiler does not emit on its own.
#pragma once

namespace mok::ptx {

// The hardware's approximate reciprocal, denormals flushed (callers refine it; see
// gemm/swiglu.cuh's reciprocal_rn).
__device__ __forceinline__ float reciprocal_approximate(float value) {
  float approximate;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(approximate) : "f"(value));
  return approximate;
}

}  // namespace mok::ptx
