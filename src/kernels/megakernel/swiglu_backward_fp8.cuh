// The SwiGLU backward of the FP8 layer (precision mode fp8, DESIGN.md §3) with the quantizations
// of its three outputs, at the CPU reference's rounding points (src/reference/quantized_engine.cpp,
// backward_row):
//
// Given a row's gate/up pre-activations (a, b: the FP8 gate/up GEMM's fp32 sums rounded to bf16,
// gate and up columns interleaved in blocks of 128 as the FP8 weight cache's rows are) and
// g = W_downᵀ dy (fp32, from the FP8 down dgrad), with w the row's router weight:
//   h = silu(a) · b                  fp32 (no bf16 rounding, as the reference)
//   d_topk_w = Σ_i g_i · h_i         fp32; no division by w
//   d_h = w · g;  (d_a, d_b) = numerics::swiglu_backward(a, b, d_h)
//                                    fp32 -> E4M3 1 x 128 along 2I (the gate/up dgrad's operand,
//                                    the I gate columns, then the I up columns), and E4M3
//                                    128 x 1 down the rows (the gate/up wgrad's operand)
//   w · h                            fp32 -> E4M3 128 x 1 down the rows (the down wgrad's operand)
// One CTA takes a 128-row block of a group (an expert's rows, or the shared expert's tokens), one
// 128-column block of I at a time: its warps compute the block's rows (lane l holds columns
// 4 l .. 4 l + 3, so a row's 1 x 128 amax is one warp maximum) and leave the fp32 values in shared
// memory, where a thread per column takes its 128 x 1 block. The bytes are those of
// quantize_transposed_kernel over the fp32 values (the same amax, scale and encoding; rows past
// the group's count read as zeros), without the fp32 round trip through memory. d_topk_w's sum
// runs in another order than the reference's (lanes over column blocks, then a fixed shuffle
// tree), the same for every row.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/megakernel/swiglu_backward.cuh"
#include "kernels/quantize/elements.cuh"
#include "kernels/quantize/layer_kernels.cuh"

namespace mok::megakernel {

inline constexpr int kSwiGluFp8Block = 128;  // rows of a CTA, columns of a pass, 1 x 128 blocks
// 32 warps of 4 rows: the kernel is bound by latency (fp8.md v10), so as many warps as the
// register file holds at 64 registers a thread.
inline constexpr int kSwiGluBackwardFp8Threads = 1024;
inline constexpr int kSwiGluFp8RowsPerWarp = kSwiGluFp8Block / (kSwiGluBackwardFp8Threads / 32);
// The three outputs of a column block: (d_a, d_b, w·h) x (128 rows, 128 columns) fp32.
inline constexpr int kSwiGluFp8Outputs = 3;
inline constexpr size_t kSwiGluFp8StagedBytes =
    size_t{kSwiGluFp8Outputs} * kSwiGluFp8Block * kSwiGluFp8Block * sizeof(float);
// The column phase: each output column's 128 x 1 block is split into kColumnParts parts of rows, a
// thread each, so that more warps share the shared-memory loads and the encoding; the parts'
// amax bits follow the staged values.
inline constexpr int kColumnParts = 2;
inline constexpr int kColumnPartRows = kSwiGluFp8Block / kColumnParts;
inline constexpr int kColumnJobs = kSwiGluFp8Outputs * kSwiGluFp8Block * kColumnParts;
static_assert(kColumnJobs <= kSwiGluBackwardFp8Threads, "a thread per part of a column");
inline constexpr size_t kSwiGluBackwardFp8SharedBytes =
    kSwiGluFp8StagedBytes + kColumnJobs * sizeof(uint32_t);

struct SwiGluBackwardFp8Rows {
  // (rows, 2I) bf16, gate/up interleaved in blocks of 128: by group row (recomputed), or (save
  // mode, saved_by_source) a saved context's, by the row's source (t, j) of its rank (row_source's
  // value), as SwiGluBackwardRows::gate_up.
  const __nv_bfloat16* gate_up;
  bool saved_by_source;
  const float* grad_hidden;  // (rows, I) fp32: g
  uint8_t* d_gate_up_codes;  // (rows, 2I) E4M3, 1 x 128 blocks of (d_a | d_b)
  float* d_gate_up_scales;   // (rows, 2I / 128)
  // (2I, padded_rows) E4M3 and (2I, padded_rows / 128) scales: (d_a | d_b) 128 x 1, column c to
  // data row GateUp8Columns(c) (the gradient's gate/up rows interleaved in blocks of 8)
  uint8_t* d_gate_up_t;
  float* d_gate_up_t_scales;
  uint8_t* hidden_t;  // (I, padded_rows) E4M3 and (I, padded_rows / 128) scales: w · h 128 x 1
  float* hidden_t_scales;
  int64_t padded_rows;          // a multiple of 128: the transposed operands' row count
  int intermediate;             // I, a multiple of 128
  quantize::ExpertRows groups;  // where each 128-row block's real rows end
};

// Four values of each lane, one 128-value block across the warp, as E4M3 codes and the block's
// scale (quantize::Format::kFp8's rule, the reference's bytes). Where every value is finite (the
// warp's largest magnitude says so, for the whole warp at once) the amax is that magnitude and
// the codes need no NaN patch; otherwise both go the general way.
__device__ __forceinline__ void quantize_warp_block(const float (&values)[4], uint8_t* codes,
                                                    float* scale, int lane) {
  using quantize::Format;
  uint32_t amax_bits = quantize::lanes_max<32>(quantize::magnitude_max_bits(values));
  const bool finite = amax_bits < fp8::kFloatExponentMask;  // (the same in every lane)
  if (!finite) amax_bits = quantize::lanes_max<32>(quantize::finite_amax_bits(values));
  const float amax = __uint_as_float(amax_bits);
  uint32_t words[1];
  quantize::encode_scaled(values, quantize::block_inverse<Format::kFp8>(amax), finite, words);
  quantize::store_codes<4>(codes, words);
  if (lane == 0) quantize::store_scale<Format::kFp8>(scale, 0, amax);
}

// Column block `block` of one row, the lane's four columns: d_a, d_b and w·h, the row's 1 x 128
// codes and scales of d_a and d_b, and Σ g · h of the four columns added to `dot` in column
// order. Every lane of the warp takes part (the blocks' amax is a warp maximum).
__device__ inline void swiglu_backward_fp8_columns(const SwiGluBackwardFp8Rows& rows, int64_t row,
                                                   int64_t gate_up_row, float weight, int64_t block,
                                                   int lane, float& dot, float (&d_gate)[4],
                                                   float (&d_up)[4], float (&weighted)[4]) {
  const int64_t inter = rows.intermediate;
  const int64_t blocks = inter / kSwiGluFp8Block;
  const int64_t col = block * kSwiGluFp8Block + lane * 4;
  const __nv_bfloat16* gate_up = rows.gate_up + gate_up_row * 2 * inter + block * 256 + lane * 4;
  const uint2 gate_bits = *reinterpret_cast<const uint2*>(gate_up);
  const uint2 up_bits = *reinterpret_cast<const uint2*>(gate_up + 128);
  const float4 grad_vector = *reinterpret_cast<const float4*>(rows.grad_hidden + row * inter + col);
  const float gates[4] = {
      __uint_as_float(gate_bits.x << 16), __uint_as_float(gate_bits.x & 0xffff0000u),
      __uint_as_float(gate_bits.y << 16), __uint_as_float(gate_bits.y & 0xffff0000u)};
  const float ups[4] = {__uint_as_float(up_bits.x << 16), __uint_as_float(up_bits.x & 0xffff0000u),
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
  uint8_t* codes = rows.d_gate_up_codes + row * 2 * inter + col;
  float* scales = rows.d_gate_up_scales + row * (2 * blocks) + block;
  quantize_warp_block(d_gate, codes, scales, lane);
  quantize_warp_block(d_up, codes + inter, scales + blocks, lane);
}

// kColumnPartRows staged values down a column (row stride 128), as groups of 4.
template <class F>
__device__ __forceinline__ void for_each_part_group(const float* values, const F& f) {
#pragma unroll
  for (int group = 0; group < kColumnPartRows / 4; ++group) {
    const float four[4] = {
        values[(4 * group) * kSwiGluFp8Block], values[(4 * group + 1) * kSwiGluFp8Block],
        values[(4 * group + 2) * kSwiGluFp8Block], values[(4 * group + 3) * kSwiGluFp8Block]};
    f(group, four);
  }
}

// RowInfo(row, &gate_up_row, &weight) -> whether the row is computed (else its outputs are zeros;
// gate_up_row: its index in rows.gate_up, < 2^31 as the workspace's rows);
// Finish(row, dot): after the last column block, every lane holding the row's Σ g · h.
// grid: padded_rows / 128 CTAs of kSwiGluBackwardFp8Threads, kSwiGluBackwardFp8SharedBytes of
// dynamic shared memory. A block whose group has no rows there is skipped (neither read nor
// written), as quantize_transposed_kernel skips it.
template <class RowInfo, class Finish>
__device__ inline void swiglu_backward_fp8_block(const SwiGluBackwardFp8Rows& rows, float* staged,
                                                 const RowInfo& row_info, const Finish& finish) {
  uint32_t* part_amax = reinterpret_cast<uint32_t*>(staged + kSwiGluFp8Outputs * kSwiGluFp8Block *
                                                                 kSwiGluFp8Block);  // (kColumnJobs)
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int warp = static_cast<int>(threadIdx.x / 32);
  constexpr int kWarps = kSwiGluBackwardFp8Threads / 32;
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * kSwiGluFp8Block;
  const int64_t row_end = rows.groups.end(row0, rows.padded_rows);
  if (row_end <= row0) return;  // (the whole CTA: before any barrier)
  // NOTE: only the sums and a mask live across the column blocks; each block asks row_info for a
  // row's source again (cached loads), which keeps the kernel in 64 registers.
  float dot[kSwiGluFp8RowsPerWarp];
  uint32_t computed = 0;  // bit j: row j of the warp is computed
#pragma unroll
  for (int j = 0; j < kSwiGluFp8RowsPerWarp; ++j) {
    const int64_t row = row0 + warp + kWarps * j;
    int32_t gate_up_row;
    float weight;
    if (row < row_end && row_info(row, gate_up_row, weight)) computed |= 1u << j;
    dot[j] = 0.0f;
  }
  const int64_t inter = rows.intermediate;
  const quantize::GateUp8Columns gate_up_columns{inter};
  for (int64_t block = 0; block < inter / kSwiGluFp8Block; ++block) {
#pragma unroll
    for (int j = 0; j < kSwiGluFp8RowsPerWarp; ++j) {
      const int tile_row = warp + kWarps * j;
      float d_gate[4] = {}, d_up[4] = {}, weighted[4] = {};
      if ((computed >> j) & 1u) {
        int32_t gate_up_row;
        float weight;
        row_info(row0 + tile_row, gate_up_row, weight);
        swiglu_backward_fp8_columns(rows, row0 + tile_row, gate_up_row, weight, block, lane, dot[j],
                                    d_gate, d_up, weighted);
      }
      float* staged_row = staged + tile_row * kSwiGluFp8Block + lane * 4;
      constexpr int kOutput = kSwiGluFp8Block * kSwiGluFp8Block;
      *reinterpret_cast<float4*>(staged_row) =
          make_float4(d_gate[0], d_gate[1], d_gate[2], d_gate[3]);
      *reinterpret_cast<float4*>(staged_row + kOutput) =
          make_float4(d_up[0], d_up[1], d_up[2], d_up[3]);
      *reinterpret_cast<float4*>(staged_row + 2 * kOutput) =
          make_float4(weighted[0], weighted[1], weighted[2], weighted[3]);
    }
    __syncthreads();
    // Thread `job` takes part `part` of output column `pair` (pair = output * 128 + column).
    const int job = static_cast<int>(threadIdx.x);
    const int pair = job % (kSwiGluFp8Outputs * kSwiGluFp8Block);
    const int part = job / (kSwiGluFp8Outputs * kSwiGluFp8Block);
    const int output = pair / kSwiGluFp8Block;
    const int column = pair % kSwiGluFp8Block;
    const float* values = staged + output * kSwiGluFp8Block * kSwiGluFp8Block +
                          part * kColumnPartRows * kSwiGluFp8Block + column;
    // The parts' largest magnitudes, NaN and Inf included (magnitude_max_bits): a column whose
    // maximum stays below the exponent mask is finite, its maximum is its amax and its codes
    // need no NaN patch. Should any column of the block hold a non-finite value, every part
    // takes its finite amax again (the general way, the reference's bytes).
    const auto part_max = [&](auto magnitude) {
      uint32_t bits = 0;
      for_each_part_group(
          values, [&](int /*group*/, const float(&four)[4]) { bits = max(bits, magnitude(four)); });
      return bits;
    };
    const auto column_max = [&] {
      uint32_t bits = 0;
#pragma unroll
      for (int other = 0; other < kColumnParts; ++other) {
        bits = max(bits, part_amax[pair + other * kSwiGluFp8Outputs * kSwiGluFp8Block]);
      }
      return bits;
    };
    if (job < kColumnJobs) {
      part_amax[job] =
          part_max([](const float(&four)[4]) { return quantize::magnitude_max_bits(four); });
    }
    __syncthreads();
    uint32_t amax_bits = job < kColumnJobs ? column_max() : 0u;
    const bool finite = amax_bits < fp8::kFloatExponentMask;
    if (__syncthreads_or(!finite)) {  // (every part_amax read above before any is written)
      if (job < kColumnJobs) {
        part_amax[job] =
            part_max([](const float(&four)[4]) { return quantize::finite_amax_bits(four); });
      }
      __syncthreads();
      if (job < kColumnJobs) amax_bits = column_max();
    }
    if (job < kColumnJobs) {
      const float amax = __uint_as_float(amax_bits);
      const float inverse = quantize::block_inverse<quantize::Format::kFp8>(amax);
      uint32_t codes[kColumnPartRows / 4];
      for_each_part_group(values, [&](int group, const float(&four)[4]) {
        uint32_t word[1];
        quantize::encode_scaled(four, inverse, finite, word);
        codes[group] = word[0];
      });
      const int64_t col = block * kSwiGluFp8Block + column;  // of I
      uint8_t* data = output == 2 ? rows.hidden_t : rows.d_gate_up_t;
      float* scales = output == 2 ? rows.hidden_t_scales : rows.d_gate_up_t_scales;
      const int64_t data_row = output == 2 ? col : gate_up_columns(output * inter + col);
      quantize::store_codes<kColumnPartRows>(
          data + data_row * rows.padded_rows + row0 + part * kColumnPartRows, codes);
      if (part == 0) {
        quantize::store_scale<quantize::Format::kFp8>(
            scales, data_row * (rows.padded_rows / kSwiGluFp8Block) + row0 / kSwiGluFp8Block, amax);
      }
    }
    __syncthreads();
  }
#pragma unroll
  for (int j = 0; j < kSwiGluFp8RowsPerWarp; ++j) {
    if (((computed >> j) & 1u) == 0) continue;
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) {
      dot[j] = numerics::add_rn(dot[j], __shfl_xor_sync(0xffffffffu, dot[j], offset));
    }
    finish(row0 + warp + kWarps * j, dot[j]);
  }
}

// The routed rows: each row's source (its weight, and in save mode its pre-activations), d_topk_w
// into the source rank's window.
__device__ inline void swiglu_backward_fp8_routed(const comm::WorkspaceView& view,
                                                  const SwiGluBackwardFp8Rows& rows,
                                                  float* staged) {
  const int lane = static_cast<int>(threadIdx.x % 32);
  swiglu_backward_fp8_block(
      rows, staged,
      [&](int64_t row, int32_t& gate_up_row, float& weight) {
        const int32_t packed = view.row_source()[row];
        if (packed < 0) return false;
        const comm::RowSource source = comm::unpack_row_source(view.layout, packed);
        weight = view.topk_w(source.rank)[source.token * view.layout.top_k + source.slot];
        gate_up_row = rows.saved_by_source ? packed : static_cast<int32_t>(row);
        return true;
      },
      [&](int64_t row, float dot) {
        if (lane != 0) return;
        const comm::RowSource source = comm::unpack_row_source(view.layout, view.row_source()[row]);
        view.d_topk_w(source.rank)[source.token * view.layout.top_k + source.slot] = dot;
      });
}

// The shared expert: this rank's tokens as one group (rows.groups), w = 1, no d_topk_w.
__device__ inline void swiglu_backward_fp8_shared(const SwiGluBackwardFp8Rows& rows,
                                                  float* staged) {
  swiglu_backward_fp8_block(
      rows, staged,
      [](int64_t row, int32_t& gate_up_row, float& weight) {
        gate_up_row = static_cast<int32_t>(row);
        weight = 1.0f;
        return true;
      },
      [](int64_t /*row*/, float /*dot*/) {});
}

}  // namespace mok::megakernel
