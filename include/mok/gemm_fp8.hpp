// The FP8 grouped expert GEMMs on Hopper (sm_90a), forward, dgrad and wgrad: the DeepSeek-V3
// recipe (DESIGN.md §3, precision mode `fp8`), over the same grouped layout as mok/gemm.hpp's
// grouped_forward / grouped_dgrad / grouped_wgrad.
//
//   y[m, n] = sum over k-blocks kb of (x_scales[m, kb] · w_scales[e, n / 128, kb]) · P[m, n, kb]
//   P[m, n, kb] = sum over k in kb of x[m, k] · w[e, n, k]   (E4M3 values, 128 of K)
//
// x and w are E4M3 (fn) bytes with fp32 scales in exactly the layouts mok/quantize.hpp's kFp8
// quantizers produce: x (capacity_rows, k) per 1 x 128 block (x_scales (capacity_rows, k / 128)),
// w (E, n, k) per 128 x 128 block (w_scales (E, ceil(n / 128), k / 128)).
//
// FP8 wgmma takes K-major operands only, so every operand is passed with the GEMM's K contiguous:
// the dgrad reads the transposed weight and the wgrad the transposed activations (below).
//
// Each P is summed by the tensor cores (whose FP8 accumulation keeps fewer bits than fp32, so P
// carries a small error of its own, bounded in tests/gpu/test_gemm_fp8.cu) and promoted into fp32
// accumulators once per 128 of K: accum = fma(P, fp32(sa · sb), accum), k-blocks in order. Results
// are bitwise identical across runs and across LaunchOptions::num_sms: every output element is
// summed by one CTA in that order (no split-K, no atomics).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "mok/gemm.hpp"

namespace mok::gemm {

// The forward kernel's pipeline (grouped_forward_fp8, grouped_dgrad_fp8), for same-binary A/B
// runs (bench_gemm_fp8 --variants); 0 picks the default (clusters of 2, 4 stages). Same bits
// whatever is chosen.
struct Fp8Pipeline {
  // CTAs per cluster: 2 = pairs of CTAs computing two M blocks of one expert at one N block, each
  // loading half of their common weight tile into both by TMA multicast; 1 = none. A grid of
  // fewer than two CTAs runs without.
  int cluster = 0;
  // Stages of the ring of bf16 (and SwiGLU) outputs: 3 or 4 (fp32 outputs always take 4).
  int stages = 0;
};

// y_e = x_e · W_eᵀ from FP8 operands. shape.k a positive multiple of 128, shape.n a positive
// multiple of 8 (16 for kSwiGluBf16, whose W is gate/up-interleaved as interleave_gate_up makes
// it); the rows of expert e as in grouped_forward (expert_offsets, optional expert_counts; no
// expert_range: every FP8 GEMM refuses one).
// x, w 16-byte aligned, y 16-byte aligned; options.engine kAuto or kCooperative (the one FP8
// engine). Asynchronous on `stream`, no host synchronisation.
void grouped_forward_fp8(const GroupedShape& shape, const uint8_t* x, const float* x_scales,
                         const uint8_t* w, const float* w_scales, const int* expert_offsets,
                         void* y, ForwardOutput output, cudaStream_t stream,
                         const LaunchOptions& options = {}, const Fp8Pipeline& pipeline = {});

// The SwiGLU forward of the gate/up GEMM in fp8: the forward's sums for W's 2I rows, then
//
//   h[m, i] = swiglu(gate sum[m, i], up sum[m, i])   in fp32 (numerics::swiglu, bit-identical)
//
// quantized per 1 x 128 along I from fp32, as quantize::describe(kFp8, 1, rows, I, 1, 128,
// false) does: h (capacity_rows, I) E4M3, h_scales (capacity_rows, I / 128) fp32 — the down
// GEMM's x. W (E, 2I, H) holds gate and up rows interleaved in blocks of 128
// (kSwiGluFp8Interleave: rows 256 b .. 256 b + 127 are gate rows 128 b .., the next 128 the same
// up rows), quantized per 128 x 128 block as grouped_forward_fp8's w, so that each block is one
// of W_gate's or W_up's own. shape.n = 2I a positive multiple of 256, shape.k a positive multiple
// of 128; rows as in grouped_forward (rows outside the experts' are not written). gate_up, unless
// null: the sums rounded to bf16 too, 2I columns in W's row order, the same bytes as
// grouped_forward_fp8's ForwardOutput::kBf16 (a training forward keeps them for the backward):
// row r at gate_up row gate_up_rows[r] (device, capacity_rows; < 0: not stored), or at row r
// when gate_up_rows is null. x, w, h, gate_up 16-byte aligned.
void grouped_swiglu_fp8(const GroupedShape& shape, const uint8_t* x, const float* x_scales,
                        const uint8_t* w, const float* w_scales, const int* expert_offsets,
                        uint8_t* h, float* h_scales, cudaStream_t stream,
                        const LaunchOptions& options = {}, const Fp8Pipeline& pipeline = {},
                        bf16* gate_up = nullptr, const int32_t* gate_up_rows = nullptr);

// dx_e = dy_e · W_e from FP8 operands: the forward kernel with K = n, N = k, on the transposed
// weight (E, k, n):
//
//   dx[m, j] = sum over n-blocks nb of (dy_scales[m, nb] · w_t_scales[e, j / 128, nb]) · P,
//   P = sum over n in nb of dy[m, n] · w_t[e, j, n]
//
// dy (capacity_rows, n) E4M3, dy_scales (capacity_rows, n / 128): quantize::describe(kFp8, 1,
// capacity_rows, n, 1, 128, false), i.e. 1 x 128 along n. w_t (E, k, n) E4M3, w_t_scales (E,
// ceil(k / 128), n / 128): the 128 x 128 quantization of the transposed weight W_eᵀ (k, n),
// quantize::describe(kFp8, E, k, n, 128, 128, false) on it. (A 128 x 128 block's scale is its
// amax, which transposing does not change, so this is exactly the forward weight's quantization
// (E, n, k) with each block's bytes transposed and the scale matrix transposed per expert:
// w_t[e, j, i] = w[e, i, j], w_t_scales[e, jb, ib] = w_scales[e, ib, jb] — for k a multiple of
// 128, as the forward needs.) shape is the forward's: shape.n a positive multiple of 128 (the
// dgrad's K), shape.k a positive multiple of 8; rows as in grouped_forward; dy, w_t, dx 16-byte
// aligned. dx (capacity_rows, k), bf16 or fp32; rows outside the experts' are not written.
void grouped_dgrad_fp8(const GroupedShape& shape, const uint8_t* dy, const float* dy_scales,
                       const uint8_t* w_t, const float* w_t_scales, const int* expert_offsets,
                       void* dx, DgradOutput output, cudaStream_t stream,
                       const LaunchOptions& options = {}, const Fp8Pipeline& pipeline = {});

// dw_e = dy_eᵀ · x_e from FP8 operands quantized along the tokens, summed over the expert's rows
// in row order, 128 rows per promotion:
//
//   dw[e, i, j] = sum over the expert's row blocks rb of
//                 (dy_t_scales[i, rb] · x_t_scales[j, rb]) · P,
//   P = sum over rows r in rb of dy_t[i, r] · x_t[j, r]
//
// dy_t (n, capacity_rows) E4M3 with dy_t_scales (n, capacity_rows / 128), and x_t (k,
// capacity_rows) with x_t_scales (k, capacity_rows / 128): the transposed kFp8 quantizations of
// dy (capacity_rows, n) and x (capacity_rows, k), quantize::describe(kFp8, 1, capacity_rows,
// n (or k), 1, 128, /*transposed=*/true) — one scale per (feature, block of 128 rows), blocks of
// 128 rows from row 0 of the tensor.
//
// Rows: shape.capacity_rows a positive multiple of 128 (the quantizer's blocks); every expert
// with rows must start on a 128-row boundary (expert_offsets[e] % 128 == 0: the layer's
// tile-padded layout, mok/shape.hpp kRowBlock; the kernel traps otherwise, as the host never
// reads the offsets), so that its row blocks are its own. Its rows are expert_offsets[e] ..
// + expert_counts[e] (or .. expert_offsets[e + 1]); in its last, partial block the rows past the
// count are zeroed on chip, never summed, whatever they hold (padding or the next expert's rows).
// That block's scales are the quantizer's over all of its 128 rows: they equal a quantization
// of the expert's rows alone (src/reference/quantized_engine.cpp's weight_grads) when the padding
// rows are zero before quantizing — as they are in the layer's padded layout; otherwise
// their amax may only coarsen the block's scale.
//
// shape.n, shape.k positive multiples of 8; dy_t, x_t 16-byte aligned, dw 16-byte aligned.
// output: kFp32 / kBf16 write dw (E, n, k) (zeros for an expert without rows); kAccumulateFp32
// starts every element's sum from main_grad (E, n, k) fp32, dw, and adds the blocks in order
// (an expert without rows leaves it unchanged). No split-K, no atomics: every element is summed
// by one CTA, so results are bitwise identical across runs and LaunchOptions::num_sms.
void grouped_wgrad_fp8(const GroupedShape& shape, const uint8_t* dy_t, const float* dy_t_scales,
                       const uint8_t* x_t, const float* x_t_scales, const int* expert_offsets,
                       void* dw, WgradOutput output, cudaStream_t stream,
                       const LaunchOptions& options = {});

}  // namespace mok::gemm
