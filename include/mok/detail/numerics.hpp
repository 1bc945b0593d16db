// The scalar math of the layer, one definition for the CPU reference and the GPU kernels.
//
// Every float operation here is an explicitly rounded multiply, add or fused multiply-add (one
// rounding, as IEEE 754 defines fma: std::fma on the host, __fmaf_rn on the device; never a
// contraction left to the compiler), and exp is computed from those operations alone, so host and
// device produce the same bits. That is what lets a GPU kernel that sums in the reference's order
// match the reference bitwise.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define MOK_HOST_DEVICE __host__ __device__ __forceinline__
#else
#include <cmath>
#define MOK_HOST_DEVICE inline
#endif

namespace mok::numerics {

MOK_HOST_DEVICE float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;  // the reference is built with -ffp-contract=off
#endif
}

MOK_HOST_DEVICE float add_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

// a * b + c with one rounding.
MOK_HOST_DEVICE float fma_rn(float a, float b, float c) {
#if defined(__CUDA_ARCH__)
  return __fmaf_rn(a, b, c);
#else
  return std::fma(a, b, c);
#endif
}

MOK_HOST_DEVICE float div_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

// The larger of a and b; b when a is NaN. Exact: nothing to round.
MOK_HOST_DEVICE float max_of(float a, float b) {
#if defined(__CUDA_ARCH__)
  return fmaxf(a, b);
#else
  return std::fmax(a, b);
#endif
}

MOK_HOST_DEVICE float bits_to_float(uint32_t bits) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(bits);
#else
  float value;
  std::memcpy(&value, &bits, sizeof(value));
  return value;
#endif
}

// exp(x) = exp(r) * 2^n with x = n*ln2 + r, |r| <= ln2/2, and exp(r) by a degree-5 polynomial
// (exp_reduced) in fused multiply-adds. No branch: valid wherever 2^n is a normal float.
struct ExpParts {
  float mantissa;  // exp(r), in [0.7, 1.42]
  float exponent;  // n, an integer
};

// n = round(x / ln 2), ties to even, for |x| < 2^21: x log2(e) + 1.5 * 2^23 rounded once lies in
// [2^23, 2^24), where the float spacing is 1, so subtracting 1.5 * 2^23 back is exact and leaves
// the nearest integer. (The GPU epilogue takes 2^n from the sum's bits instead.)
constexpr float kLog2e = 1.44269502f;
constexpr float kRoundShift = 12582912.0f;  // 1.5 * 2^23

MOK_HOST_DEVICE float exp_rounded_exponent(float x) {
  return add_rn(fma_rn(x, kLog2e, kRoundShift), -kRoundShift);
}

// exp(x - n ln 2) for the integer n = exp_rounded_exponent(x), given n.
//
// Cheap enough for the SwiGLU epilogue, where every operation here is paid 64 times per thread
// and tile while the tensor cores wait (docs/perf-notes/gemm.md): the reduction takes ln 2 as
// one float (1.9e-9 off, which n turns into up to n * 0.032 * 2^-24 of relative error in exp,
// about 4 * 2^-24 at n = 126), and exp(r) = 1 + r + r^2 q(r) with q of degree 3: a minimax fit
// (Remez exchange on the relative error of exp over |r| <= ln2/2, truncation error 1.76 * 2^-24)
// whose coefficients were rounded to float and then moved by a few float steps to minimise the
// measured error of this evaluation (2.69 * 2^-24). The exact 1 + r keeps exp(0) = 1.
// Measured against std::exp in double for every float x in [-87, 88.5]: exp within 6.7 * 2^-24
// relative and 1 + exp(x) within 5.6 ulp; on [-87, 87], 1 / (1 + exp(x)) within 5.7 ulp. All far
// below the bf16 rounding of h (2^-9) that follows. (The previous definition, ln 2 in two
// constants and a degree-4 q: 1.35 * 2^-24, two operations more per SwiGLU output.)
MOK_HOST_DEVICE float exp_reduced(float x, float n) {
  constexpr float kLn2 = 0x1.62e430p-1f;  // ln 2 rounded to float
  const float r = fma_rn(-n, kLn2, x);
  float p = 0x1.106284p-7f;
  p = fma_rn(p, r, 0x1.5729fp-5f);
  p = fma_rn(p, r, 0x1.5557a2p-3f);
  p = fma_rn(p, r, 0x1.fffdfcp-2f);
  p = fma_rn(p, r, 1.0f);
  p = fma_rn(p, r, 1.0f);
  return p;
}

MOK_HOST_DEVICE ExpParts exp_parts(float x) {
  const float n = exp_rounded_exponent(x);
  return {exp_reduced(x, n), n};
}

// 2^n for an integer n in [-126, 127].
MOK_HOST_DEVICE float power_of_two(float n) {
  return bits_to_float(static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23);
}

// exp(x) for x in [-87, 88.5] from exp_parts(x): n reaches 128 above 88.38, where 2^n is no
// float, so the scale goes in two steps there.
MOK_HOST_DEVICE float exp_of_parts(ExpParts parts) {
  if (parts.exponent > 127.0f) {
    return mul_rn(mul_rn(parts.mantissa, 2.0f), bits_to_float(0x7f000000u));
  }
  return mul_rn(parts.mantissa, power_of_two(parts.exponent));
}

// exp(x) within 7 * 2^-24 relative on [-87, 88.5] (exp_reduced), bit-identical on host and
// device. Above 88.5 it returns +inf; below -87, 0.
MOK_HOST_DEVICE float exp_deterministic(float x) {
  if (!(x == x)) return x;                           // NaN
  if (x > 88.5f) return bits_to_float(0x7f800000u);  // +inf
  if (x < -87.0f) return 0.0f;                       // below the normal range: flush
  return exp_of_parts(exp_parts(x));                 // n in [-126, 128]
}

// 1 + exp(t), with exp's two parts joined by one fused multiply-add: mantissa * 2^n + 1 rounded
// once (no separate rounding of exp(t)). Below -87 the sum rounds to 1 either way (it does below
// about -16.6, where exp(t) < 2^-24), so t is clamped there, which keeps 2^n a normal float. From
// 87 up it is add_rn(1, exp_deterministic(t)), huge or infinite; the parts are computed once for
// both cases so that the generic SwiGLU path inlines one exp, not two.
MOK_HOST_DEVICE float one_plus_exp(float t) {
  if (!(t == t)) return t;                           // NaN
  if (t > 88.5f) return bits_to_float(0x7f800000u);  // 1 + exp_deterministic(t) = +inf
  const ExpParts parts = exp_parts(max_of(t, -87.0f));
  if (t >= 87.0f) return add_rn(1.0f, exp_of_parts(parts));
  return fma_rn(parts.mantissa, power_of_two(parts.exponent), 1.0f);  // n in [-126, 126]
}

MOK_HOST_DEVICE float sigmoid(float x) { return div_rn(1.0f, one_plus_exp(-x)); }

// h = silu(g) * u from s = sigmoid(g): the one formula for every caller that has s already.
MOK_HOST_DEVICE float swiglu_from_sigmoid(float gate, float up, float s) {
  return mul_rn(mul_rn(gate, s), up);
}

// h = silu(g) * u, in fp32 from the GEMM's fp32 accumulators (the caller rounds h for storage).
MOK_HOST_DEVICE float swiglu(float gate, float up) {
  return swiglu_from_sigmoid(gate, up, sigmoid(gate));
}

struct SwiGluGrad {
  float d_gate;
  float d_up;
};

// Given d_h, the gradient of h = silu(g) * u:
//   d_up = d_h * silu(g),  d_gate = d_h * u * s * (1 + g * (1 - s)),  s = sigmoid(g).
// s = sigmoid(g), computed by the caller.
MOK_HOST_DEVICE SwiGluGrad swiglu_backward_from_sigmoid(float gate, float up, float d_h, float s) {
  const float silu = mul_rn(gate, s);
  const float d_silu = add_rn(1.0f, mul_rn(gate, add_rn(1.0f, -s)));
  return {mul_rn(mul_rn(mul_rn(d_h, up), s), d_silu), mul_rn(d_h, silu)};
}
MOK_HOST_DEVICE SwiGluGrad swiglu_backward(float gate, float up, float d_h) {
  return swiglu_backward_from_sigmoid(gate, up, d_h, sigmoid(gate));
}

#if !defined(__CUDA_ARCH__)
// fp64 versions for the oracle (host only): the same formulas with no rounding to speak of.
inline double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }
inline double swiglu(double gate, double up) { return gate * sigmoid(gate) * up; }
struct SwiGluGradF64 {
  double d_gate;
  double d_up;
};
inline SwiGluGradF64 swiglu_backward(double gate, double up, double d_h) {
  const double s = sigmoid(gate);
  return {d_h * up * s * (1.0 + gate * (1.0 - s)), d_h * gate * s};
}
#endif

}  // namespace mok::numerics
