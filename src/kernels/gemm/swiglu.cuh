// SwiGLU of a tile's accumulators, bit-identical to numerics::swiglu (the CPU reference's
// definition) and fast enough to sit in the gate/up GEMM's epilogue.
//
// numerics::swiglu(g, u) = mul_rn(mul_rn(g, 1 / one_plus_exp(-g)), u) with an IEEE division and
// a 1 + exp with early returns for NaN and overflow. In the epilogue each thread computes 64 of
// them while the tensor cores wait, so the branches matter: they wall every element into its own
// scheduling region. For g > -87 neither branch is needed: exp(-g) cannot overflow, and the
// divisor 1 + exp(-g) lies in [1, 2^126), where an approximate reciprocal refined by fma steps is
// the correctly rounded 1/d. Both branch-free pieces are checked exhaustively over their ranges by
// tests/gpu/test_gemm_swiglu.cu. A thread holding any gate at or below -87 (or NaN) takes the
// generic path.
#pragma once

#include "mok/detail/numerics.hpp"

namespace mok::gemm {

// Gates above this keep 1 + exp(-g) below e^87 + 1 < 2^126, the range reciprocal_rn covers.
constexpr float kFastSwiGluGateFloor = -87.0f;

// numerics::one_plus_exp(t) for t < 87, the same operations without its early returns: below
// 87 neither the NaN nor the overflow case can occur, and the clamp at -87 is one max. Checked
// bitwise against the definition for every float below 87 by tests/gpu/test_gemm_swiglu.cu.
//
// No float/integer conversion either: the sum that rounds t / ln 2 (exp_rounded_exponent) holds
// n itself in its low mantissa bits, so 2^n is built from them with integer operations.
__device__ __forceinline__ float one_plus_exp_below_87(float t) {
  constexpr uint32_t kShiftBits = 0x4B400000u;  // bits of numerics::kRoundShift
  t = numerics::max_of(t, -87.0f);
  const float shifted = numerics::fma_rn(t, numerics::kLog2e, numerics::kRoundShift);
  const float n = numerics::add_rn(shifted, -numerics::kRoundShift);
  // t in [-87, 87): n in [-126, 126], so 2^n is a normal float.
  const float scale = __uint_as_float((__float_as_uint(shifted) - kShiftBits + 127u) << 23);
  return numerics::fma_rn(numerics::exp_reduced(t, n), scale, 1.0f);
}

// 1/d rounded to nearest even, for d in [1, 2^126); no branch.
__device__ __forceinline__ float reciprocal_rn(float d) {
  float approximate;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(approximate) : "f"(d));
  const float error = __fmaf_rn(-d, approximate, 1.0f);
  const float refined = __fmaf_rn(error, approximate, approximate);
  const float residual = __fmaf_rn(-d, refined, 1.0f);
  return __fmaf_rn(residual, refined, refined);
}

// numerics::swiglu for g > kFastSwiGluGateFloor, with the same rounding points.
__device__ __forceinline__ float swiglu_fast(float gate, float up) {
  const float denominator = one_plus_exp_below_87(-gate);
  return numerics::mul_rn(numerics::mul_rn(gate, reciprocal_rn(denominator)), up);
}

// In the (64, N) accumulator fragment of an 8-interleaved gate/up tile, accum[0, kNumAccumulators)
// (N = 4 kNumAccumulators columns), blocks (j, j + 1) hold gate and up of the same columns:
// h = swiglu(g, u) overwrites the gate accumulators.
template <int kNumAccumulators, int kSize>
__device__ __forceinline__ void swiglu_in_place(float (&accum)[kSize]) {
  static_assert(kNumAccumulators <= kSize && kNumAccumulators % 8 == 0, "whole gate/up blocks");
  bool all_fast = true;
#pragma unroll
  for (int pair = 0; pair < kNumAccumulators / 2; ++pair) {
    all_fast &= accum[8 * (pair / 4) + pair % 4] > kFastSwiGluGateFloor;
  }
  // Flat loops the compiler fully unrolls (a nested one was left rolled, which sent the
  // accumulators to local memory).
  if (all_fast) {
#pragma unroll 64
    for (int pair = 0; pair < kNumAccumulators / 2; ++pair) {
      const int gate = 8 * (pair / 4) + pair % 4;
      accum[gate] = swiglu_fast(accum[gate], accum[gate + 4]);
    }
  } else {
#pragma unroll 64
    for (int pair = 0; pair < kNumAccumulators / 2; ++pair) {
      const int gate = 8 * (pair / 4) + pair % 4;
      accum[gate] = numerics::swiglu(accum[gate], accum[gate + 4]);
    }
  }
}

}  // namespace mok::gemm
