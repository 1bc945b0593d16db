// SwiGLU of a tile's accumulators, bit-identical to numerics::swiglu (the CPU reference's
// definition) and fast enough to sit in the gate/up GEMM's epilogue.
//
// numerics::swiglu(g, u) = mul_rn(mul_rn(g, 1 / one_plus_exp(-g)), u) with an IEEE division and
// a 1 + exp with early returns for NaN and overflow and a clamp for underflow. In the epilogue
// each thread computes 64 of them while the tensor cores wait, so the branches matter: they wall
// every element into its own scheduling region. For |g| < 87 none is needed: exp(-g) neither
// overflows nor leaves the normal range, and the divisor 1 + exp(-g) lies in [1, 2^126), where
// an approximate reciprocal refined by an fma step is the correctly rounded 1/d. Both branch-free
// pieces are checked exhaustively over their ranges by tests/gpu/test_gemm_swiglu.cu. A thread
// holding any gate with |g| >= 87 (or NaN) takes the generic path.
#pragma once

#include "kernels/ptx/math.cuh"
#include "mok/detail/numerics.hpp"

namespace mok::gemm {

// Gates with |g| below this keep exp(-g) in the normal range and 1 + exp(-g) below
// e^87 + 1 < 2^126, the range reciprocal_rn covers.
constexpr float kFastSwiGluGateLimit = 87.0f;

// Whether the fast path takes this gate (false for NaN).
__device__ __forceinline__ bool swiglu_gate_is_fast(float gate) {
  return fabsf(gate) < kFastSwiGluGateLimit;
}

// numerics::one_plus_exp(t) for |t| < 87, the same operations without its early returns and its
// clamp at -87, none of which acts there. Checked bitwise against the definition for every float
// of (-87, 87) by tests/gpu/test_gemm_swiglu.cu.
//
// No float/integer conversion either: the sum that rounds t / ln 2 (exp_rounded_exponent) holds
// n itself in its low mantissa bits, so 2^n is built from them with integer operations.
__device__ __forceinline__ float one_plus_exp_fast(float t) {
  constexpr uint32_t kShiftBits = 0x4B400000u;  // bits of numerics::kRoundShift
  const float shifted = numerics::fma_rn(t, numerics::kLog2e, numerics::kRoundShift);
  const float n = numerics::add_rn(shifted, -numerics::kRoundShift);
  // t in (-87, 87): n in [-126, 126], so 2^n is a normal float.
  const float scale = __uint_as_float((__float_as_uint(shifted) - kShiftBits + 127u) << 23);
  return numerics::fma_rn(numerics::exp_reduced(t, n), scale, 1.0f);
}

// 1/d rounded to nearest even, for d in [1, 2^126); no branch. One Newton step from the
// hardware's approximation: its result is within ~2^-46 of 1/d, and no 1/d of that range lies so
// close to a rounding boundary that the step rounds the other way. That is not provable from the
// documented accuracy of rcp.approx alone (1/d comes within 2^-49 of a midpoint, e.g. for
// d = 2 - 2^-23), so it rests on the exhaustive check of every float of the range in
// tests/gpu/test_gemm_swiglu.cu (one step found no mismatch on H200 where two had been used
// before: two fmas fewer per SwiGLU output, docs/perf-notes/gemm.md).
__device__ __forceinline__ float reciprocal_rn(float d) {
  const float approximate = ptx::reciprocal_approximate(d);
  const float error = __fmaf_rn(-d, approximate, 1.0f);
  return __fmaf_rn(error, approximate, approximate);
}

// numerics::sigmoid for |g| < kFastSwiGluGateLimit: the same bits (1 + exp(-g) lies in
// [1, 2^126) there, where reciprocal_rn is the correctly rounded 1 / d).
__device__ __forceinline__ float sigmoid_fast(float gate) {
  return reciprocal_rn(one_plus_exp_fast(-gate));
}

// numerics::swiglu for |g| < kFastSwiGluGateLimit, with the same rounding points.
__device__ __forceinline__ float swiglu_fast(float gate, float up) {
  return numerics::swiglu_from_sigmoid(gate, up, sigmoid_fast(gate));
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
    all_fast &= swiglu_gate_is_fast(accum[8 * (pair / 4) + pair % 4]);
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

// In the (64, N) accumulator fragment of a 128-interleaved gate/up tile (kSwiGluFp8Interleave),
// accum[j] and accum[j + kHalf] hold gate and up of the same column for j < kHalf (fragment block
// b and b + N / 16): h = swiglu(g, u) overwrites accum[0, kHalf).
template <int kHalf, int kSize>
__device__ __forceinline__ void swiglu_halves_in_place(float (&accum)[kSize]) {
  static_assert(2 * kHalf <= kSize, "gate and up halves");
  bool all_fast = true;
#pragma unroll
  for (int j = 0; j < kHalf; ++j) all_fast &= swiglu_gate_is_fast(accum[j]);
  if (all_fast) {
#pragma unroll 64
    for (int j = 0; j < kHalf; ++j) accum[j] = swiglu_fast(accum[j], accum[j + kHalf]);
  } else {
#pragma unroll 64
    for (int j = 0; j < kHalf; ++j) accum[j] = numerics::swiglu(accum[j], accum[j + kHalf]);
  }
}

}  // namespace mok::gemm
