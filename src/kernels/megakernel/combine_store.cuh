// The routed down GEMM's epilogue in the fused forward is the combine push: the GEMM engine's
// bf16 epilogue (gemm::Epilogue<kForward, kStoreBf16>, same values and staging) with this row
// destination, so each output row goes straight to where the combine reads it — a peer's token
// into that peer's slot (t, j) over NVLink, this rank's own token into its own slot (or, in a
// workspace that has expert_y, there, where the reduce reads it in place) — and no separate push
// copies it.
#pragma once

#include "kernels/comm/workspace_layout.cuh"
#include "kernels/gemm/gemm_types.cuh"
#include "kernels/gemm/tile_scheduler.cuh"

namespace mok::megakernel {

struct RowsToOwners {
  const comm::WorkspaceView* view;
  int64_t first_row;  // the tile's first row in the call's expert rows (row_source's index)

  template <class Fragment>
  __device__ char* operator()(const Fragment& f, const gemm::GroupedTile& /*tile*/,
                              int tile_row) const {
    const int64_t row = first_row + tile_row;
    // A row inside the expert's count always has a source (padding rows lie past it).
    const comm::RowSource source = comm::unpack_row_source(view->layout, view->row_source()[row]);
    char* row_start = source.rank == view->rank && view->layout.has_expert_y()
                          ? view->expert_y_row(row)
                          : view->slot_row(source.rank, source.token, source.slot);
    return row_start + f.column_bytes;
  }
  // The rows of the row block `blocks` on (a carried tail's: compute.cuh).
  __device__ RowsToOwners block(int blocks) const {
    return {view, first_row + blocks * gemm::TileConfig::BLOCK_M};
  }
};

}  // namespace mok::megakernel
