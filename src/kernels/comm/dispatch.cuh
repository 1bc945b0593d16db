// Dispatch: the expert's rank pulls each of its rows from the token owner's window.
// Row `row` of the local expert buffer is token t of rank r (row_source), copied from
// window(r).x[t]. Padding rows are left unwritten: consumers stop at each expert's count.
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

__device__ inline void dispatch_pull_fp8(const WorkspaceView& view, const Fp8RowsOut& out) {
  if (cta_sees_error(view)) return;
  const int64_t num_rows = view.offsets()[view.layout.experts_per_rank()];
  const int64_t hidden = view.layout.hidden;
  const int64_t num_scales = hidden / 128;
  const int lane = threadIdx.x % 32;
  const int64_t warps_per_cta = blockDim.x / 32;
  for (int64_t row = blockIdx.x * warps_per_cta + threadIdx.x / 32; row < num_rows;
       row += gridDim.x * warps_per_cta) {
    const int32_t packed = view.row_source()[row];
    if (packed < 0) continue;
    const RowSource source = unpack_row_source(view.layout, packed);
    const char* slot = view.x_row(source.rank, source.token);
    // The E4M3 bytes: H, a multiple of 128, in 16-byte vectors.
    copy_row_warp<RowLoad::kCoherent>(slot, reinterpret_cast<char*>(out.data + row * hidden),
                                      hidden, lane);
    // The scales: H / 128 floats (a multiple of 16 bytes only where H is of 512).
    const float* scales = reinterpret_cast<const float*>(slot + hidden);
    for (int64_t i = lane; i < num_scales; i += 32) out.scales[row * num_scales + i] = scales[i];
  }
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
