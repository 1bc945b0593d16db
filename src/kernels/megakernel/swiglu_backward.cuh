// The SwiGLU backward between the backward's two dgrad GEMMs, one warp per expert row.
//
// Given a row's gate/up pre-activations (a, b: the gate/up GEMM's output rounded to bf16, as a
// saved context keeps them; gate and up columns interleaved in blocks of 8 as the fused weight's
// rows are) and g = W_downᵀ dy (fp32, on the unscaled dy row), with w the row's router weight:
//   h = bf16(silu(a) · b)            the hidden value again, from the stored a and b
//   d_topk_w = Σ_i g_i · h_i         fp32; no division by w (w may be 0 or negative)
//   d_h = w · g;  (d_a, d_b) = numerics::swiglu_backward(a, b, d_h)    -> bf16, interleaved
//   w · h                            -> bf16, the down projection's wgrad operand
// The shared expert is the same with w = 1 and no d_topk_w. Every value follows the CPU
// reference's formulas (include/mok/detail/numerics.hpp); only d_topk_w's sum runs in another
// order (lanes over column blocks, then a fixed shuffle tree), the same for every row, whichever
// rank or grid computes it.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/comm/workspace_layout.cuh"
#include "kernels/gemm/swiglu.cuh"
#include "mok/detail/numerics.hpp"

namespace mok::megakernel {

inline constexpr int kSwiGluBackwardThreads = 256;
inline constexpr int kSwiGluBlock = 8;  // the gate/up interleave: 8 gate columns, then 8 up

struct SwiGluBackwardRows {
  // (rows, 2I) bf16, 8-interleaved: by expert row (recomputed), or (save mode, saved_by_source)
  // a saved context's, by the row's source (t, j) of its rank (row_source's value).
  const __nv_bfloat16* gate_up;
  bool saved_by_source;
  const float* grad_hidden;        // (rows, I) fp32: g = W_downᵀ dy
  __nv_bfloat16* d_gate_up;        // (rows, 2I) bf16, 8-interleaved; may be grad_hidden's bytes
  __nv_bfloat16* weighted_hidden;  // (rows, I) bf16: w · h
  int intermediate;                // I, a multiple of 8
};

// Blocks of 8 columns a lane loads before it computes them: their loads in flight together (one
// block at a time left the kernel far below HBM bandwidth, each load waiting for the last;
// perf-notes/backward.md).
inline constexpr int kSwiGluBlocksAtOnce = 4;

// One row: returns Σ_i g_i · h_i (every lane holds the same value). gate_up_row: the row's
// index in rows.gate_up. Lane l takes column blocks l, l + 32, ... and sums them in that order.
__device__ inline float swiglu_backward_row(const SwiGluBackwardRows& rows, int64_t row,
                                            int64_t gate_up_row, float weight, int lane) {
  const int64_t inter = rows.intermediate;
  const int64_t blocks = inter / kSwiGluBlock;
  const __nv_bfloat16* gate_up = rows.gate_up + gate_up_row * 2 * inter;  // (2I)
  const float* grad_hidden = rows.grad_hidden + row * inter;              // (I)
  __nv_bfloat16* d_gate_up = rows.d_gate_up + row * 2 * inter;
  __nv_bfloat16* weighted_hidden = rows.weighted_hidden + row * inter;
  float dot = 0.0f;
  for (int64_t first = lane; first < blocks; first += 32 * kSwiGluBlocksAtOnce) {
    // (8 gate, 8 up) bf16 and 8 g of each block: four 16-byte loads.
    int4 gate_vector[kSwiGluBlocksAtOnce], up_vector[kSwiGluBlocksAtOnce];
    float4 grad_vector[kSwiGluBlocksAtOnce][2];
#pragma unroll
    for (int u = 0; u < kSwiGluBlocksAtOnce; ++u) {
      const int64_t block = first + 32 * u;
      if (block >= blocks) continue;
      const int4* gate_up_vectors =
          reinterpret_cast<const int4*>(gate_up + block * 2 * kSwiGluBlock);
      gate_vector[u] = gate_up_vectors[0];
      up_vector[u] = gate_up_vectors[1];
      const float4* grad_vectors =
          reinterpret_cast<const float4*>(grad_hidden + block * kSwiGluBlock);
      grad_vector[u][0] = grad_vectors[0];
      grad_vector[u][1] = grad_vectors[1];
    }
    // NOTE: d_gate_up may be grad_hidden's bytes (block b of each is the same 32 bytes of the
    // row): every load above comes before any store below, which the types alone would not keep.
    asm volatile("" ::: "memory");
#pragma unroll
    for (int u = 0; u < kSwiGluBlocksAtOnce; ++u) {
      const int64_t block = first + 32 * u;
      if (block >= blocks) continue;
      const __nv_bfloat16* gate_values = reinterpret_cast<const __nv_bfloat16*>(&gate_vector[u]);
      const __nv_bfloat16* up_values = reinterpret_cast<const __nv_bfloat16*>(&up_vector[u]);
      const float* grad = reinterpret_cast<const float*>(&grad_vector[u][0]);
      __align__(16) __nv_bfloat16 d_gate[kSwiGluBlock], d_up[kSwiGluBlock],
          hidden_out[kSwiGluBlock];
      // sigmoid(a) once per element, branch-free when the block's gates allow it (the same bits
      // as numerics::sigmoid: gemm/swiglu.cuh); it was the kernel's cost (perf-notes/backward.md).
      float sigmoids[kSwiGluBlock];
      bool all_fast = true;
#pragma unroll
      for (int i = 0; i < kSwiGluBlock; ++i) {
        all_fast &= gemm::swiglu_gate_is_fast(__bfloat162float(gate_values[i]));
      }
      if (all_fast) {
#pragma unroll
        for (int i = 0; i < kSwiGluBlock; ++i) {
          sigmoids[i] = gemm::sigmoid_fast(__bfloat162float(gate_values[i]));
        }
      } else {
#pragma unroll
        for (int i = 0; i < kSwiGluBlock; ++i) {
          sigmoids[i] = numerics::sigmoid(__bfloat162float(gate_values[i]));
        }
      }
#pragma unroll
      for (int i = 0; i < kSwiGluBlock; ++i) {
        const float gate = __bfloat162float(gate_values[i]);
        const float up = __bfloat162float(up_values[i]);
        const float hidden = __bfloat162float(
            __float2bfloat16_rn(numerics::swiglu_from_sigmoid(gate, up, sigmoids[i])));
        dot = numerics::add_rn(dot, numerics::mul_rn(grad[i], hidden));
        const numerics::SwiGluGrad d = numerics::swiglu_backward_from_sigmoid(
            gate, up, numerics::mul_rn(weight, grad[i]), sigmoids[i]);
        d_gate[i] = __float2bfloat16_rn(d.d_gate);
        d_up[i] = __float2bfloat16_rn(d.d_up);
        hidden_out[i] = __float2bfloat16_rn(numerics::mul_rn(weight, hidden));
      }
      int4* d_vectors = reinterpret_cast<int4*>(d_gate_up + block * 2 * kSwiGluBlock);
      d_vectors[0] = *reinterpret_cast<const int4*>(d_gate);
      d_vectors[1] = *reinterpret_cast<const int4*>(d_up);
      *reinterpret_cast<int4*>(weighted_hidden + block * kSwiGluBlock) =
          *reinterpret_cast<const int4*>(hidden_out);
    }
  }
  // NOTE: a butterfly: every lane ends with the same sum, built in the same order for every row.
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    dot = numerics::add_rn(dot, __shfl_xor_sync(0xffffffffu, dot, offset));
  }
  return dot;
}

// The expert rows a routed pass covers: every local expert's (the workspace's row_source, up to
// its last offset) or a chunk's (megakernel/expert_chunks.cuh), rows counted from the chunk's
// first.
struct RoutedRowSet {
  const int32_t* row_source;  // (rows): each row's packed source, -1 for padding
  const int32_t* end;         // (1): the rows
};
MOK_COMM_HOST_DEVICE RoutedRowSet every_routed_row(const comm::WorkspaceView& view) {
  return {view.row_source(), view.offsets() + view.layout.experts_per_rank()};
}

// Every row of the set that holds a token's (t, j), a warp each (padding rows are skipped: no
// GEMM reads them into a result): backward_row(row, packed source, w) returns the row's d_topk_w
// (every lane the same), which goes into the owner's window (one writer per element); w comes
// from there too.
template <class BackwardRow>
__device__ inline void for_each_routed_row(const comm::WorkspaceView& view, const RoutedRowSet& set,
                                           const BackwardRow& backward_row) {
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / 32);
  const int64_t num_rows = *set.end;
  for (int64_t row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32; row < num_rows;
       row += warps) {
    const int32_t packed = set.row_source[row];
    if (packed < 0) continue;
    const comm::RowSource source = comm::unpack_row_source(view.layout, packed);
    const int64_t slot = source.token * view.layout.top_k + source.slot;
    const float weight = view.topk_w(source.rank)[slot];
    const float dot = backward_row(row, packed, weight);
    if (lane == 0) view.d_topk_w(source.rank)[slot] = dot;
  }
}

// Rows [0, num_rows) of this rank's tokens (the shared expert), a warp each.
template <class BackwardRow>
__device__ inline void for_each_shared_row(int64_t num_rows, const BackwardRow& backward_row) {
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / 32);
  for (int64_t row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32; row < num_rows;
       row += warps) {
    backward_row(row);
  }
}

// The set's routed rows (rows' g, d_gate_up, w·h and recomputed gate/up row-indexed as the
// set's); in save mode their pre-activations are read by source.
__device__ inline void swiglu_backward_routed(const comm::WorkspaceView& view,
                                              const SwiGluBackwardRows& rows,
                                              const RoutedRowSet& set) {
  const int lane = static_cast<int>(threadIdx.x % 32);
  for_each_routed_row(view, set, [&](int64_t row, int32_t packed, float weight) {
    return swiglu_backward_row(rows, row, rows.saved_by_source ? packed : row, weight, lane);
  });
}

// The shared expert: rows [0, num_rows) of this rank's tokens, w = 1.
__device__ inline void swiglu_backward_shared(const SwiGluBackwardRows& rows, int64_t num_rows) {
  const int lane = static_cast<int>(threadIdx.x % 32);
  for_each_shared_row(num_rows,
                      [&](int64_t row) { swiglu_backward_row(rows, row, row, 1.0f, lane); });
}

}  // namespace mok::megakernel
