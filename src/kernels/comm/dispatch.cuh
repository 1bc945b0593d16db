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
