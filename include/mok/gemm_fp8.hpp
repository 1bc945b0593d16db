// The FP8 grouped expert GEMM on Hopper (sm_90a), forward: the DeepSeek-V3 recipe (DESIGN.md §3,
// precision mode `fp8`), over the same grouped layout as mok/gemm.hpp's grouped_forward.
//
//   y[m, n] = sum over k-blocks kb of (x_scales[m, kb] · w_scales[e, n / 128, kb]) · P[m, n, kb]
//   P[m, n, kb] = sum over k in kb of x[m, k] · w[e, n, k]   (E4M3 values, 128 of K)
//
// x and w are E4M3 (fn) bytes with fp32 scales in exactly the layouts mok/quantize.hpp's kFp8
// quantizers produce: x (capacity_rows, k) per 1 x 128 block (x_scales (capacity_rows, k / 128)),
// w (E, n, k) per 128 x 128 block (w_scales (E, ceil(n / 128), k / 128)).
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

// y_e = x_e · W_eᵀ from FP8 operands. shape.k a positive multiple of 128, shape.n a positive
// multiple of 8 (16 for kSwiGluBf16, whose W is gate/up-interleaved as interleave_gate_up makes
// it); the rows of expert e as in grouped_forward (expert_offsets, optional expert_counts).
// x, w 16-byte aligned, y 16-byte aligned; options.engine kAuto or kCooperative (the one FP8
// engine). Asynchronous on `stream`, no host synchronisation.
void grouped_forward_fp8(const GroupedShape& shape, const uint8_t* x, const float* x_scales,
                         const uint8_t* w, const float* w_scales, const int* expert_offsets,
                         void* y, ForwardOutput output, cudaStream_t stream,
                         const LaunchOptions& options = {});

}  // namespace mok::gemm
