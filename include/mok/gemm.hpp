// Grouped expert GEMMs on Hopper (sm_90a): forward, dgrad and wgrad over experts whose rows are
// contiguous in the row-indexed tensors, with the per-expert row offsets in device memory (the
// host never reads them, so every call is asynchronous and graph-capturable).
//
// All tensors are device pointers, row-major, bf16 unless said otherwise. Rows of expert e are
// expert_offsets[e] .. expert_offsets[e + 1] (int32, device, non-decreasing, at most
// capacity_rows); rows past expert_offsets[E] are neither read into any result nor written.
// Results are bitwise identical across runs and across the number of SMs used: every output
// element is summed by one CTA in natural K order (no split-K, no atomics).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <vector>

#include "mok/bf16.hpp"

namespace mok::gemm {

struct GroupedShape {
  int num_experts = 0;
  int capacity_rows = 0;  // rows allocated in the row-indexed tensors
  int n = 0;              // out features of the forward GEMM (rows of W_e)
  int k = 0;              // in features of the forward GEMM (columns of W_e)
  // Optional (device, E int32): rows of expert e are expert_offsets[e] .. expert_offsets[e] +
  // expert_counts[e], the rest up to expert_offsets[e + 1] being padding that no tile reads into
  // a result (a tile-padded row layout, as the layer's schedule makes). Null: every row up to
  // expert_offsets[e + 1] is the expert's. A negative count leaves expert e out of the call: no
  // row of it is read and nothing of its result is written (a wgrad writes no zeros for it), so
  // that a call can cover a chunk of the experts.
  const int* expert_counts = nullptr;
  // Optional (device, capacity_rows int32), for bf16 results of grouped_forward and grouped_dgrad
  // only: row r of the result is written to row output_rows[r] of y / dx instead of row r (a
  // scatter: e.g. each expert row straight to its token's slot, rows t · k + j); y / dx then needs
  // as many rows as the largest index + 1. Rows past the experts' counts are never written either
  // way. Null: row r.
  const int* output_rows = nullptr;
  // Optional (device, 2 int32): only experts expert_range[0] .. expert_range[1] - 1 take part in
  // the call, every other one as if its count were negative (nothing read, nothing written), and
  // the tiles are found among those alone: a call over a chunk of the experts costs what its
  // experts do, an empty range next to nothing. Null: every expert.
  const int* expert_range = nullptr;
};

// Which kernel runs a grouped GEMM. Both sum every output element over the same k-blocks in the
// same order, so the results are bitwise equal whichever runs; only the speed differs.
enum class GemmEngine {
  kAuto,         // the faster one for the case, as measured (docs/perf-notes/gemm.md)
  kCooperative,  // two consumer warpgroups share one 128 x 256 tile (epilogues stall the MMAs)
  kPingpong,     // each consumer warpgroup owns a 128 x 128 tile; their mainloops alternate
};

struct LaunchOptions {
  int num_sms = 0;  // CTAs of the persistent grid; 0 = every SM of the current device
  GemmEngine engine = GemmEngine::kAuto;
  // wgrad on the cooperative engine: CTAs per cluster, each loading a share of the tiles' common
  // x operand into all of them (TMA multicast); 0 = the default (2), 1 = no clusters. A grid of
  // fewer than two CTAs runs without. Same bits either way.
  int wgrad_cluster = 0;
  // kAuto's engine for fp32-output dgrads and for bf16 forwards with K > 1536 looks at the rows a
  // group gets on average: this call's (a layer knows them from its tokens), or 0 = not given
  // (the dgrad then takes capacity_rows / num_experts; the forward stays cooperative). Same bits
  // either way.
  int group_rows = 0;
};

enum class ForwardOutput {
  kBf16,        // y [capacity_rows, n] bf16
  kSwiGluBf16,  // h [capacity_rows, n / 2] bf16 = swiglu(gate, up); W_e gate/up-interleaved
  kFp32,        // y [capacity_rows, n] fp32
};

enum class WgradOutput {
  kFp32,            // dw [E, n, k] fp32, overwritten
  kBf16,            // dw [E, n, k] bf16, overwritten
  kAccumulateFp32,  // main_grad [E, n, k] fp32 += dYᵀ·X (accumulators start from main_grad)
};

// y_e = x_e · W_eᵀ. x [capacity_rows, k], w [E, n, k]; k and n multiples of 8 (16 for SwiGLU).
void grouped_forward(const GroupedShape& shape, const bf16* x, const bf16* w,
                     const int* expert_offsets, void* y, ForwardOutput output, cudaStream_t stream,
                     const LaunchOptions& options = {});

enum class DgradOutput {
  kBf16,  // dx [capacity_rows, k] bf16
  kFp32,  // dx [capacity_rows, k] fp32
};

// dx_e = dy_e · W_e. dy [capacity_rows, n], w [E, n, k], dx [capacity_rows, k].
void grouped_dgrad(const GroupedShape& shape, const bf16* dy, const bf16* w,
                   const int* expert_offsets, void* dx, DgradOutput output, cudaStream_t stream,
                   const LaunchOptions& options = {});
inline void grouped_dgrad(const GroupedShape& shape, const bf16* dy, const bf16* w,
                          const int* expert_offsets, bf16* dx, cudaStream_t stream,
                          const LaunchOptions& options = {}) {
  grouped_dgrad(shape, dy, w, expert_offsets, dx, DgradOutput::kBf16, stream, options);
}

// dw_e = dy_eᵀ · x_e, summed over the expert's rows in row order. dy [capacity_rows, n],
// x [capacity_rows, k], dw [E, n, k].
void grouped_wgrad(const GroupedShape& shape, const bf16* dy, const bf16* x,
                   const int* expert_offsets, void* dw, WgradOutput output, cudaStream_t stream,
                   const LaunchOptions& options = {});

// The fused gate/up weight the SwiGLU forward expects: [E, 2I, H] with gate and up rows
// interleaved in blocks of 8 (rows 16b..16b+7 = gate rows 8b..8b+7, rows 16b+8..16b+15 = up rows
// 8b..8b+7). gate, up: [E, I, H]; I a multiple of 8.
inline std::vector<bf16> interleave_gate_up(const std::vector<bf16>& gate,
                                            const std::vector<bf16>& up, int num_experts,
                                            int intermediate, int hidden) {
  constexpr int kBlock = 8;
  std::vector<bf16> fused(gate.size() * 2);
  for (int e = 0; e < num_experts; ++e) {
    for (int i = 0; i < intermediate; ++i) {
      const size_t source = (static_cast<size_t>(e) * intermediate + i) * hidden;
      const size_t gate_row =
          static_cast<size_t>(e) * 2 * intermediate + (i / kBlock) * 2 * kBlock + i % kBlock;
      for (int h = 0; h < hidden; ++h) {
        fused[gate_row * hidden + h] = gate[source + h];
        fused[(gate_row + kBlock) * hidden + h] = up[source + h];
      }
    }
  }
  return fused;
}

// The inverse of interleave_gate_up, for values of any type (e.g. the fp32 gradient of the fused
// weight): fused [E, 2I, H] -> gate and up [E, I, H], appended to `gate` and `up`.
template <class T>
void split_gate_up(const std::vector<T>& fused, int64_t num_experts, int64_t intermediate,
                   int64_t hidden, std::vector<T>& gate, std::vector<T>& up) {
  constexpr int64_t kBlock = 8;
  for (int64_t e = 0; e < num_experts; ++e) {
    for (int64_t i = 0; i < intermediate; ++i) {
      const int64_t row = e * 2 * intermediate + (i / kBlock) * 2 * kBlock + i % kBlock;
      const T* gate_row = fused.data() + row * hidden;
      const T* up_row = gate_row + kBlock * hidden;
      gate.insert(gate.end(), gate_row, gate_row + hidden);
      up.insert(up.end(), up_row, up_row + hidden);
    }
  }
}

}  // namespace mok::gemm
