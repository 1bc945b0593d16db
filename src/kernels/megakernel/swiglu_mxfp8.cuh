// The SwiGLU steps of the mxfp8 layer on the bf16 engine (precision mode mxfp8, docs/quantize.md),
// at the CPU reference's rounding points (src/reference/quantized_engine.cpp), their outputs
// quantized to mxfp8 and dequantized again as bf16 (kernels/quantize/mx_round_trip.cuh). Gate and
// up columns are interleaved in blocks of 8, as the bf16 engine's gate/up weight rows are.
//
// Forward (mx_swiglu_kernel): from the gate/up GEMM's fp32 sums, h = numerics::swiglu(g, u) in
// fp32, round-tripped 1 x 32 along I (no bf16 rounding of h first); save mode also keeps the sums
// rounded to bf16 (the saved context's pre-activations, as the bf16 layer keeps them).
//
// Backward (swiglu_backward_mx_kernel), given a row's pre-activations a, b (bf16) and
// g = W_downᵀ dy (fp32), w the row's router weight (1 for the shared expert):
//   h = silu(a) · b                  fp32
//   d_topk_w = Σ_i g_i · h_i         fp32 (lanes over 32 columns, a fixed butterfly, the 32-column
//                                    chunks in order: the same order for every row)
//   d_h = w · g;  (d_a, d_b) = numerics::swiglu_backward(a, b, d_h)
//                                    -> 1 x 32 along [d_a | d_b] (the gate/up dgrad's operand) and
//                                       32 x 1 down the group's rows (the gate/up wgrad's)
//   w · h                            -> 32 x 1 down the group's rows (the down wgrad's)
// A CTA takes a 32-row block of a group (an expert's rows from its first, or the shared expert's
// tokens), 32 columns of I at a time: each warp computes 4 rows (a lane per column; a row's
// 1 x 32 amax is one warp maximum) into shared memory, where a thread per output column takes its
// 32 x 1 block; the rows past the group's count are neither read nor written.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/comm/flags.cuh"
#include "kernels/comm/workspace_layout.cuh"
#include "kernels/gemm/swiglu.cuh"
#include "kernels/quantize/elements.cuh"
#include "kernels/quantize/mx_round_trip.cuh"
#include "mok/detail/fp8_numerics.hpp"
#include "mok/detail/numerics.hpp"

namespace mok::megakernel {

using quantize::kMxBlock;

// ---- forward ----------------------------------------------------------------------------------

inline constexpr int kMxSwiGluThreads = 256;

// sums (rows, 2I) fp32 -> hidden (rows, I) bf16 bits, h round-tripped 1 x 32; the rows below
// *row_bound (device; null: rows) whose row_source is not negative (null: every row). saved: the
// sums rounded to bf16 at row row_source[r] (null row_source: r), or null. A lane per 4 columns of
// h (its 4 gate and 4 up sums: two 16-byte loads), a 32-column block in 8 lanes (amax by
// shuffles), any grid. (static: a definition of its own in every file that includes this one.)
static __global__ void __launch_bounds__(kMxSwiGluThreads)
    mx_swiglu_kernel(const float* __restrict__ sums, uint16_t* __restrict__ hidden,
                     uint16_t* __restrict__ saved, const int32_t* __restrict__ row_source,
                     int64_t rows, int64_t inter, const int32_t* __restrict__ row_bound) {
  constexpr int kColumns = 4;  // of h, a lane
  constexpr int kLanes = kMxBlock / kColumns;
  const int64_t units_per_row = inter / kColumns;
  const int64_t num_rows = row_bound != nullptr ? static_cast<int64_t>(*row_bound) : rows;
  const int64_t num_units = num_rows * units_per_row;
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / 32);
  // (the loop's bound is the warp's: every lane takes part in the shuffles; a row's units are whole
  // blocks of 8 lanes, I being a multiple of 32)
  for (int64_t base =
           (static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32) * 32;
       base < num_units; base += warps * 32) {
    const int64_t unit = base + lane;
    const int64_t row = unit / units_per_row;
    const int64_t column = unit % units_per_row * kColumns;
    int32_t source = -1;  // a padding row between experts (no GEMM wrote it), or past the end
    if (unit < num_units)
      source = row_source != nullptr ? row_source[row] : static_cast<int32_t>(row);
    const bool live = source >= 0;
    // 4 gate sums, and the 4 up sums 8 further (the interleave's blocks of 8)
    const int64_t pair = row * 2 * inter + quantize::GateUp8Columns{inter}(column);
    float4 gate = make_float4(0.0f, 0.0f, 0.0f, 0.0f), up = gate;
    if (live) {
      gate = *reinterpret_cast<const float4*>(sums + pair);
      up = *reinterpret_cast<const float4*>(sums + pair + 8);
    }
    const float g[kColumns] = {gate.x, gate.y, gate.z, gate.w};
    const float u[kColumns] = {up.x, up.y, up.z, up.w};
    // numerics::swiglu, branch-free where the lane's gates allow it (the same bits:
    // gemm/swiglu.cuh).
    bool all_fast = true;
#pragma unroll
    for (int c = 0; c < kColumns; ++c) all_fast &= gemm::swiglu_gate_is_fast(g[c]);
    float values[kColumns];
#pragma unroll
    for (int c = 0; c < kColumns; ++c) {
      values[c] = all_fast ? gemm::swiglu_fast(g[c], u[c]) : numerics::swiglu(g[c], u[c]);
    }
    const quantize::MxBlockScale round_trip(
        quantize::mx_code(quantize::lanes_max<kLanes>(quantize::finite_amax_bits(values))));
    if (!live) continue;
    const uint32_t h01 = quantize::mx_bf16_bits(round_trip(values[0])) |
                         (quantize::mx_bf16_bits(round_trip(values[1])) << 16);
    const uint32_t h23 = quantize::mx_bf16_bits(round_trip(values[2])) |
                         (quantize::mx_bf16_bits(round_trip(values[3])) << 16);
    *reinterpret_cast<uint2*>(hidden + row * inter + column) = make_uint2(h01, h23);
    if (saved == nullptr) continue;
    uint16_t* saved_pair =
        saved + static_cast<int64_t>(source) * 2 * inter + quantize::GateUp8Columns{inter}(column);
    *reinterpret_cast<uint2*>(saved_pair) =
        make_uint2(quantize::mx_bf16_bits(g[0]) | (quantize::mx_bf16_bits(g[1]) << 16),
                   quantize::mx_bf16_bits(g[2]) | (quantize::mx_bf16_bits(g[3]) << 16));
    *reinterpret_cast<uint2*>(saved_pair + 8) =
        make_uint2(quantize::mx_bf16_bits(u[0]) | (quantize::mx_bf16_bits(u[1]) << 16),
                   quantize::mx_bf16_bits(u[2]) | (quantize::mx_bf16_bits(u[3]) << 16));
  }
}

// ---- backward ---------------------------------------------------------------------------------

inline constexpr int kSwiGluBackwardMxThreads = 256;
inline constexpr int kSwiGluBackwardMxWarps = kSwiGluBackwardMxThreads / 32;
inline constexpr int kSwiGluBackwardMxRowsPerWarp = kMxBlock / kSwiGluBackwardMxWarps;
inline constexpr int kSwiGluBackwardMxOutputs = 3;  // d_a, d_b, w·h

struct SwiGluBackwardMxRows {
  // (rows, 2I) bf16 pre-activations: by group row (recomputed), or (save mode, saved_by_source)
  // a saved context's, by the row's source (t, j) of its rank (row_source's value).
  const __nv_bfloat16* gate_up;
  bool saved_by_source;
  const float* grad_hidden;     // (rows, I) fp32: g
  uint16_t* d_gate_up_rows;     // (rows, 2I) bf16: [d_a | d_b] round-tripped 1 x 32
  uint16_t* d_gate_up_columns;  // (rows, 2I) bf16: d_a, d_b round-tripped 32 x 1 down the rows
  uint16_t* weighted_hidden;    // (rows, I) bf16: w·h round-tripped 32 x 1 down the rows
  int intermediate;             // I, a multiple of 32
  quantize::MxColumnGroups groups;
};

// The sum of a value over the warp's lanes, every lane the same, in a fixed order.
__device__ __forceinline__ float mx_warp_sum(float value) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    value = numerics::add_rn(value, __shfl_xor_sync(0xffffffffu, value, offset));
  }
  return value;
}

// One 32-row block (block) of group `group`: weight_of(row, &packed) gives the row's router weight
// and its source; store_dot(row, packed, d_topk_w) takes the row's d_topk_w. staged: the CTA's
// kSwiGluBackwardMxOutputs x 32 x 33 floats of shared memory.
template <class WeightOf, class StoreDot>
__device__ inline void swiglu_backward_mx_block(const SwiGluBackwardMxRows& rows, int64_t first,
                                                int64_t count, int64_t block, float* staged,
                                                const WeightOf& weight_of,
                                                const StoreDot& store_dot) {
  const int lane = static_cast<int>(threadIdx.x % 32), warp = static_cast<int>(threadIdx.x / 32);
  const int64_t inter = rows.intermediate;
  const quantize::GateUp8Columns gate_up_column{inter};  // [d_a | d_b]'s columns, interleaved
  const int64_t r0 = block * kMxBlock;
  const int n = static_cast<int>(count - r0 < kMxBlock ? count - r0 : kMxBlock);
  float weight[kSwiGluBackwardMxRowsPerWarp], dot[kSwiGluBackwardMxRowsPerWarp];
  int32_t packed[kSwiGluBackwardMxRowsPerWarp];
#pragma unroll
  for (int k = 0; k < kSwiGluBackwardMxRowsPerWarp; ++k) {
    const int r = warp + kSwiGluBackwardMxWarps * k;
    dot[k] = 0.0f;
    weight[k] = 0.0f;
    packed[k] = -1;
    if (r < n) weight[k] = weight_of(first + r0 + r, packed[k]);
  }
  const auto stage = [&](int output, int r, int c) -> float& {
    return staged[(output * kMxBlock + r) * (kMxBlock + 1) + c];
  };
  for (int64_t chunk = 0; chunk < inter / kMxBlock; ++chunk) {
    const int64_t column = chunk * kMxBlock + lane;
    const int64_t gate_column = gate_up_column(column);  // (its up column 8 further)
#pragma unroll
    for (int k = 0; k < kSwiGluBackwardMxRowsPerWarp; ++k) {
      const int r = warp + kSwiGluBackwardMxWarps * k;
      if (r >= n) continue;  // (the whole warp: r is the warp's)
      const int64_t row = first + r0 + r;
      const int64_t gate_up_row = rows.saved_by_source ? packed[k] : row;
      const __nv_bfloat16* pre = rows.gate_up + gate_up_row * 2 * inter + gate_column;
      const float a = __bfloat162float(pre[0]), b = __bfloat162float(pre[8]);
      const float g = rows.grad_hidden[row * inter + column];
      // numerics::sigmoid's bits, branch-free below |a| = 87 (gemm/swiglu.cuh).
      const float s = gemm::swiglu_gate_is_fast(a) ? gemm::sigmoid_fast(a) : numerics::sigmoid(a);
      const float h = numerics::swiglu_from_sigmoid(a, b, s);
      dot[k] = numerics::add_rn(dot[k], mx_warp_sum(numerics::mul_rn(g, h)));
      const numerics::SwiGluGrad d =
          numerics::swiglu_backward_from_sigmoid(a, b, numerics::mul_rn(weight[k], g), s);
      const float wh = numerics::mul_rn(weight[k], h);
      // 1 x 32 along [d_a | d_b]: the 32 columns of this chunk, of d_a, then of d_b.
      const float values[2] = {d.d_gate, d.d_up};
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const quantize::MxBlockScale round_trip(
            quantize::mx_code(quantize::lanes_max<32>(fp8::finite_magnitude_bits(values[half]))));
        rows.d_gate_up_rows[row * 2 * inter + gate_column + 8 * half] =
            static_cast<uint16_t>(quantize::mx_bf16_bits(round_trip(values[half])));
      }
      stage(0, r, lane) = d.d_gate;
      stage(1, r, lane) = d.d_up;
      stage(2, r, lane) = wh;
    }
    __syncthreads();
    // 32 x 1 down the block's rows: a thread per (output, column).
    if (threadIdx.x < kSwiGluBackwardMxOutputs * kMxBlock) {
      const int output = static_cast<int>(threadIdx.x / kMxBlock);
      const int c = static_cast<int>(threadIdx.x % kMxBlock);
      uint32_t amax_bits = 0;
      for (int r = 0; r < n; ++r) {
        amax_bits = max(amax_bits, fp8::finite_magnitude_bits(stage(output, r, c)));
      }
      const quantize::MxBlockScale round_trip(quantize::mx_code(amax_bits));
      const int64_t col = chunk * kMxBlock + c;
      for (int r = 0; r < n; ++r) {
        const int64_t row = first + r0 + r;
        const uint16_t bits =
            static_cast<uint16_t>(quantize::mx_bf16_bits(round_trip(stage(output, r, c))));
        if (output == 2) {
          rows.weighted_hidden[row * inter + col] = bits;
        } else {
          rows.d_gate_up_columns[row * 2 * inter + gate_up_column(col + output * inter)] = bits;
        }
      }
    }
    __syncthreads();
  }
#pragma unroll
  for (int k = 0; k < kSwiGluBackwardMxRowsPerWarp; ++k) {
    const int r = warp + kSwiGluBackwardMxWarps * k;
    if (r < n && lane == 0) store_dot(first + r0 + r, packed[k], dot[k]);
  }
}

// Every 32-row block of every group: groups on the grid's y (with a stride), blocks on x.
template <class WeightOf, class StoreDot>
__device__ inline void swiglu_backward_mx_groups(const SwiGluBackwardMxRows& rows, float* staged,
                                                 const WeightOf& weight_of,
                                                 const StoreDot& store_dot) {
  for (int group = blockIdx.y; group < rows.groups.num_groups; group += gridDim.y) {
    const int64_t first = rows.groups.first(group), count = rows.groups.count(group);
    const int64_t blocks = (count + kMxBlock - 1) / kMxBlock;
    for (int64_t block = blockIdx.x; block < blocks; block += gridDim.x) {
      swiglu_backward_mx_block(rows, first, count, block, staged, weight_of, store_dot);
    }
  }
}

inline constexpr int kSwiGluBackwardMxStaged = kSwiGluBackwardMxOutputs * kMxBlock * (kMxBlock + 1);

// The routed rows: w and d_topk_w through the owner's window, as the bf16 SwiGLU backward's.
static __global__ void __launch_bounds__(kSwiGluBackwardMxThreads)
    swiglu_backward_mx_routed_kernel(comm::WorkspaceView view, SwiGluBackwardMxRows rows) {
  if (comm::cta_sees_error(view)) return;
  __shared__ float staged[kSwiGluBackwardMxStaged];
  swiglu_backward_mx_groups(
      rows, staged,
      [&](int64_t row, int32_t& packed) {
        packed = view.row_source()[row];
        const comm::RowSource source = comm::unpack_row_source(view.layout, packed);
        return view.topk_w(source.rank)[source.token * view.layout.top_k + source.slot];
      },
      [&](int64_t /*row*/, int32_t packed, float dot) {
        const comm::RowSource source = comm::unpack_row_source(view.layout, packed);
        view.d_topk_w(source.rank)[source.token * view.layout.top_k + source.slot] = dot;
      });
}

// The shared expert: w = 1, no d_topk_w.
static __global__ void __launch_bounds__(kSwiGluBackwardMxThreads)
    swiglu_backward_mx_shared_kernel(SwiGluBackwardMxRows rows) {
  __shared__ float staged[kSwiGluBackwardMxStaged];
  swiglu_backward_mx_groups(
      rows, staged,
      [](int64_t row, int32_t& packed) {
        packed = static_cast<int32_t>(row);
        return 1.0f;
      },
      [](int64_t, int32_t, float) {});
}

}  // namespace mok::megakernel
