// The SwiGLU backward of the FP8 layer (precision mode fp8, DESIGN.md §3), one warp per expert row,
// at the CPU reference's rounding points (src/reference/quantized_engine.cpp, backward_row):
//
// Given a row's gate/up pre-activations (a, b: the FP8 gate/up GEMM's fp32 sums rounded to bf16,
// gate and up columns interleaved in blocks of 128 as the FP8 weight cache's rows are) and
// g = W_downᵀ dy (fp32, from the FP8 down dgrad), with w the row's router weight:
//   h = silu(a) · b                  fp32 (no bf16 rounding, as the reference)
//   d_topk_w = Σ_i g_i · h_i         fp32; no division by w
//   d_h = w · g;  (d_a, d_b) = numerics::swiglu_backward(a, b, d_h)
//                                    -> fp32 (the gate/up wgrad's operand, quantized along the
//                                       rows later) and E4M3 1 x 128 along 2I from fp32 (the
//                                       gate/up dgrad's operand), the I gate columns, then the I up
//                                       columns
//   w · h                            -> fp32, the down wgrad's operand
// Lane l holds columns 4 l .. 4 l + 3 of each 128-column block, so a block's amax is one warp
// maximum. d_topk_w's sum runs in another order than the reference's (lanes over blocks, then a
// fixed shuffle tree), the same for every row.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/megakernel/swiglu_backward.cuh"
#include "kernels/quantize/elements.cuh"

namespace mok::megakernel {

struct SwiGluBackwardFp8Rows {
  // (rows, 2I) bf16, gate/up interleaved in blocks of 128: by expert row (recomputed), or (save
  // mode, saved_by_source) a saved context's, by the row's source (t, j) of its rank (row_source's
  // value), as SwiGluBackwardRows::gate_up.
  const __nv_bfloat16* gate_up;
  bool saved_by_source;
  const float* grad_hidden;  // (rows, I) fp32: g
  float* d_gate_up;          // (rows, 2I) fp32: gate columns, then up columns
  uint8_t* d_gate_up_codes;  // (rows, 2I) E4M3, 1 x 128 blocks of d_gate_up
  float* d_gate_up_scales;   // (rows, 2I / 128)
  float* weighted_hidden;    // (rows, I) fp32: w · h
  int intermediate;          // I, a multiple of 128
};

// Four values of each lane, one 128-value block across the warp, as E4M3 codes and the block's
// scale (quantize::Format::kFp8's rule, the reference's bytes).
__device__ __forceinline__ void quantize_warp_block(const float (&values)[4], uint8_t* codes,
                                                    float* scale, int lane) {
  using quantize::Format;
  const float amax = __uint_as_float(quantize::lanes_max<32>(quantize::finite_amax_bits(values)));
  uint32_t words[1];
  quantize::encode_scaled(values, quantize::block_inverse<Format::kFp8>(amax), words);
  quantize::store_codes<4>(codes, words);
  if (lane == 0) quantize::store_scale<Format::kFp8>(scale, 0, amax);
}

// One row: returns Σ_i g_i · h_i (every lane the same value). gate_up_row: the row's index in
// rows.gate_up.
__device__ inline float swiglu_backward_fp8_row(const SwiGluBackwardFp8Rows& rows, int64_t row,
                                                int64_t gate_up_row, float weight, int lane) {
  const int64_t inter = rows.intermediate;
  const int64_t blocks = inter / 128;
  const __nv_bfloat16* gate_up = rows.gate_up + gate_up_row * 2 * inter;
  const float* grad_hidden = rows.grad_hidden + row * inter;
  float* d_gate_up = rows.d_gate_up + row * 2 * inter;
  uint8_t* codes = rows.d_gate_up_codes + row * 2 * inter;
  float* scales = rows.d_gate_up_scales + row * (2 * blocks);
  float* weighted_hidden = rows.weighted_hidden + row * inter;
  float dot = 0.0f;
  for (int64_t block = 0; block < blocks; ++block) {
    const int64_t col = block * 128 + lane * 4;
    const uint2 gate_bits = *reinterpret_cast<const uint2*>(gate_up + block * 256 + lane * 4);
    const uint2 up_bits = *reinterpret_cast<const uint2*>(gate_up + block * 256 + 128 + lane * 4);
    const float4 grad_vector = *reinterpret_cast<const float4*>(grad_hidden + col);
    const float gates[4] = {
        __uint_as_float(gate_bits.x << 16), __uint_as_float(gate_bits.x & 0xffff0000u),
        __uint_as_float(gate_bits.y << 16), __uint_as_float(gate_bits.y & 0xffff0000u)};
    const float ups[4] = {
        __uint_as_float(up_bits.x << 16), __uint_as_float(up_bits.x & 0xffff0000u),
        __uint_as_float(up_bits.y << 16), __uint_as_float(up_bits.y & 0xffff0000u)};
    const float grads[4] = {grad_vector.x, grad_vector.y, grad_vector.z, grad_vector.w};
    // sigmoid(a) once per element, branch-free where the gates allow it (the same bits as
    // numerics::sigmoid: gemm/swiglu.cuh).
    bool all_fast = true;
#pragma unroll
    for (int i = 0; i < 4; ++i) all_fast &= gemm::swiglu_gate_is_fast(gates[i]);
    float sigmoids[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      sigmoids[i] = all_fast ? gemm::sigmoid_fast(gates[i]) : numerics::sigmoid(gates[i]);
    }
    float d_gate[4], d_up[4], weighted[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float hidden = numerics::swiglu_from_sigmoid(gates[i], ups[i], sigmoids[i]);
      dot = numerics::add_rn(dot, numerics::mul_rn(grads[i], hidden));
      const numerics::SwiGluGrad d = numerics::swiglu_backward_from_sigmoid(
          gates[i], ups[i], numerics::mul_rn(weight, grads[i]), sigmoids[i]);
      d_gate[i] = d.d_gate;
      d_up[i] = d.d_up;
      weighted[i] = numerics::mul_rn(weight, hidden);
    }
    *reinterpret_cast<float4*>(d_gate_up + col) =
        make_float4(d_gate[0], d_gate[1], d_gate[2], d_gate[3]);
    *reinterpret_cast<float4*>(d_gate_up + inter + col) =
        make_float4(d_up[0], d_up[1], d_up[2], d_up[3]);
    *reinterpret_cast<float4*>(weighted_hidden + col) =
        make_float4(weighted[0], weighted[1], weighted[2], weighted[3]);
    quantize_warp_block(d_gate, codes + col, scales + block, lane);
    quantize_warp_block(d_up, codes + inter + col, scales + blocks + block, lane);
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    dot = numerics::add_rn(dot, __shfl_xor_sync(0xffffffffu, dot, offset));
  }
  return dot;
}

__device__ inline void swiglu_backward_fp8_routed(const comm::WorkspaceView& view,
                                                  const SwiGluBackwardFp8Rows& rows) {
  const int lane = static_cast<int>(threadIdx.x % 32);
  for_each_routed_row(view, [&](int64_t row, int32_t packed, float weight) {
    return swiglu_backward_fp8_row(rows, row, rows.saved_by_source ? packed : row, weight, lane);
  });
}

__device__ inline void swiglu_backward_fp8_shared(const SwiGluBackwardFp8Rows& rows,
                                                  int64_t num_rows) {
  const int lane = static_cast<int>(threadIdx.x % 32);
  for_each_shared_row(num_rows,
                      [&](int64_t row) { swiglu_backward_fp8_row(rows, row, row, 1.0f, lane); });
}

}  // namespace mok::megakernel
