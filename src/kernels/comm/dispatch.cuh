// Dispatch: the expert's rank pulls each of its rows from the token owner's window.
// Row `row` of the local expert buffer is token t of rank r (row_source), copied from
// window(r).x[t]. Padding rows are left unwritten: consumers stop at each expert's count. One
// rank alone copies by token instead (dispatch_tokens_local), from the caller's tensors.
#pragma once

#include <cstdint>

#include "kernels/comm/flags.cuh"
#include "kernels/comm/row_copy.cuh"
#include "kernels/comm/workspace_layout.cuh"

namespace mok::comm {

struct DispatchRows {
  WorkspaceView view;
  DispatchTensor tensor = DispatchTensor::kX;
  __device__ RowCopy operator()(int64_t row) const {
    const int32_t packed = view.row_source()[row];
    if (packed < 0) return {nullptr, nullptr};
    const RowSource source = unpack_row_source(view.layout, packed);
    if (tensor == DispatchTensor::kDy) {
      return {view.dy_row(source.rank, source.token), view.expert_dy_row(row)};
    }
    return {view.x_row(source.rank, source.token), view.expert_x_row(row)};
  }
};

// The fp8 forward's rows: each owner stages its tokens quantized 1 x 128 along H into its x slots
// as packed rows (H E4M3 bytes, then H / 128 fp32 scales: H · 33 / 32 of the slot's 2H bytes), and
// a row is pulled into two local arrays, the E4M3 bytes (rows, H) and the scales (rows, H / 128),
// the layout the FP8 GEMM reads. Half the bytes of the bf16 rows, and no second quantization: the
// bytes every copy of a token gets are its owner's quantization's.
struct Fp8RowsOut {
  uint8_t* data;  // (rows, H)
  float* scales;  // (rows, H / 128)
};

// One token's fp8 row between its two forms, by a warp: H E4M3 bytes (H a multiple of 128, in
// 16-byte vectors) and H / 128 scales (a multiple of 16 bytes only where H is of 512, so by lane).
// The packed slot holds the bytes, then the scales.
template <RowLoad kLoad>
__device__ inline void copy_fp8_row_warp(const uint8_t* data_in, const float* scales_in,
                                         uint8_t* data_out, float* scales_out, int64_t hidden,
                                         int lane) {
  copy_row_warp<kLoad>(reinterpret_cast<const char*>(data_in), reinterpret_cast<char*>(data_out),
                       hidden, lane);
  for (int64_t i = lane; i < hidden / 128; i += 32) scales_out[i] = scales_in[i];
}

__device__ inline void dispatch_pull_fp8(const WorkspaceView& view, const Fp8RowsOut& out) {
  if (cta_sees_error(view)) return;
  const int64_t hidden = view.layout.hidden;
  const int64_t num_scales = hidden / 128;
  for_each_row_warp(view.offsets()[view.layout.experts_per_rank()], [&](int64_t row, int lane) {
    const int32_t packed = view.row_source()[row];
    if (packed < 0) return;
    const RowSource source = unpack_row_source(view.layout, packed);
    const char* slot = view.x_row(source.rank, source.token);
    copy_fp8_row_warp<RowLoad::kCoherent>(
        reinterpret_cast<const uint8_t*>(slot), reinterpret_cast<const float*>(slot + hidden),
        out.data + row * hidden, out.scales + row * num_scales, hidden, lane);
  });
}

// Where the dispatch by token writes: x's and dy's expert rows (either null where that tensor is
// not dispatched), and, for a chunk of the experts (LayerBackwardOptions::chunk_rows), window:
// device int32 {first row, rows} of the expert rows the chunk holds, which land in x_rows and
// dy_rows from their first row (row - first); null: every expert row, at its index.
struct TokenRowsOut {
  char* x_rows = nullptr;
  char* dy_rows = nullptr;
  const int32_t* window = nullptr;
};

// One rank alone (EP 1), every routed row is one of its own tokens', so the dispatch can walk the
// tokens instead of the rows: a warp reads token t's row once and writes it to the expert row of
// each of its slots (local_row, from the schedule). The pull reads a token's row once per slot, in
// the experts' order, where the (T, H) rows do not stay in L2; this reads each once
// (perf-notes/backward.md). x, dy: the caller's (T, H) tensors (either null: the other's
// rows only). A token none of whose slots is in the window is not read.
__device__ inline void dispatch_tokens_local(const WorkspaceView& view, const char* x,
                                             const char* dy, const TokenRowsOut& out) {
  const int32_t window_first = out.window != nullptr ? out.window[0] : 0;
  const int32_t window_rows = out.window != nullptr ? out.window[1] : INT32_MAX;
  if (window_rows <= 0) return;  // an empty chunk: no token to walk
  if (cta_sees_error(view)) return;
  constexpr int kUnroll = 4;  // 16-byte vectors a lane holds
  const WorkspaceLayout& layout = view.layout;
  const int32_t* ids = view.topk(view.rank, view.rank);
  const int32_t* local_row = view.local_row();
  const int64_t top_k = layout.top_k, row_bytes = layout.row_bytes();
  const int64_t num_vectors = row_bytes / 16;
  // One tensor's row of `token` to the expert rows that lanes [0, slots) hold (-1: none).
  const auto scatter = [&](const char* rows, char* expert_rows, int64_t token, int32_t row,
                           int slots, int lane) {
    const int4* source = reinterpret_cast<const int4*>(rows + token * row_bytes);
    // (the same trip counts in every lane: the shuffles below take the whole warp)
    for (int64_t base = 0; base < num_vectors; base += 32 * kUnroll) {
      int4 values[kUnroll];
#pragma unroll
      for (int unroll = 0; unroll < kUnroll; ++unroll) {
        const int64_t index = base + unroll * 32 + lane;
        if (index < num_vectors) values[unroll] = __ldg(source + index);
      }
      for (int slot = 0; slot < slots; ++slot) {
        const int32_t destination = __shfl_sync(0xffffffffu, row, slot);
        if (destination < 0) continue;
        int4* to = reinterpret_cast<int4*>(expert_rows + destination * row_bytes);
#pragma unroll
        for (int unroll = 0; unroll < kUnroll; ++unroll) {
          const int64_t index = base + unroll * 32 + lane;
          if (index < num_vectors) to[index] = values[unroll];
        }
      }
    }
  };
  const int64_t num_tokens = view.token_counts(view.rank)[view.rank];
  for_each_row_warp(num_tokens, [&](int64_t token, int lane) {
    for (int64_t first = 0; first < top_k; first += 32) {
      const int slots = static_cast<int>(top_k - first < 32 ? top_k - first : 32);
      int32_t row = -1;  // lane i: the expert row of slot first + i, within the window
      if (lane < slots) {
        const int64_t index = token * top_k + first + lane;
        if (ids[index] >= 0) {
          const int32_t expert_row = local_row[index] - window_first;
          if (expert_row >= 0 && expert_row < window_rows) row = expert_row;
        }
      }
      if (__ballot_sync(0xffffffffu, row >= 0) == 0) continue;  // (the same in every lane)
      if (x != nullptr) scatter(x, out.x_rows, token, row, slots, lane);
      if (dy != nullptr) scatter(dy, out.dy_rows, token, row, slots, lane);
    }
  });
}

// Every row of every local expert; the gather flags were acquired by the schedule, and a kernel
// boundary separates it from this pull.
__device__ inline void dispatch_pull(const WorkspaceView& view,
                                     DispatchTensor tensor = DispatchTensor::kX) {
  if (cta_sees_error(view)) return;
  const int64_t num_rows = view.offsets()[view.layout.experts_per_rank()];
  const DispatchRows rows{view, tensor};
  copy_rows_vector</*kSourceReadOnly=*/false>(num_rows, view.layout.row_bytes(), rows);
}

}  // namespace mok::comm
