// The routed down GEMM's epilogue in the fused forward: each output row goes straight to where
// the combine reads it — a peer's token into that peer's slot (t, j) over NVLink, this rank's own
// token into expert_y (the reduce reads it in place) — so no separate combine push copies it.
//
// Same values as gemm::Epilogue<kForward, kStoreBf16> (one bf16 rounding of each fp32
// accumulator, staged through shared memory and copied out per row by bulk copies); only the
// destination of each row differs.
#pragma once

#include <cuda_bf16.h>

#include "kernels/comm/workspace_layout.cuh"
#include "kernels/gemm/gemm_types.cuh"
#include "kernels/ptx/barrier.cuh"
#include "kernels/ptx/tma.cuh"
#include "kernels/schedule/tile_scheduler.cuh"

namespace mok::megakernel {

// Consumer warpgroup `consumer_idx`'s (64, BLOCK_N) fragment of a down tile (accumulator layout:
// gemm/epilogue.cuh). `n` is the output width (H).
template <uint32_t kStagingPitch>
__device__ inline void store_rows_to_owners(const comm::WorkspaceView& view, int n,
                                            const gemm::GroupedTile& tile, int consumer_idx,
                                            uint8_t* staging,
                                            const float (&accum)[gemm::TileConfig::BLOCK_N / 2]) {
  using Config = gemm::TileConfig;
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int warp_first_row = consumer_idx * 64 + static_cast<int>(threadIdx.x / 32) % 4 * 16;
  uint8_t* warp_staging = staging + warp_first_row * kStagingPitch;
  // The previous tile's copies must have finished reading these staging rows.
  if (lane < 16) ptx::bulk_wait_group_read<0>();
  __syncwarp();
  const int column = 2 * (lane % 4);
#pragma unroll
  for (int j = 0; j < Config::BLOCK_N / 8; ++j) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int index = 4 * j + 2 * half;
      *reinterpret_cast<__nv_bfloat162*>(warp_staging + (lane / 4 + 8 * half) * kStagingPitch +
                                         (column + 8 * j) * 2) =
          __floats2bfloat162_rn(accum[index], accum[index + 1]);
    }
  }
  // NOTE: the bulk copy engine reads through the async proxy.
  ptx::fence_proxy_async_shared();
  __syncwarp();
  if (lane < 16) {
    const int tile_row = warp_first_row + lane;
    const int rows_valid = tile.row_count - tile.m_block * Config::BLOCK_M;
    const int column_begin = tile.n_block * Config::BLOCK_N;
    const int columns = min(n - column_begin, Config::BLOCK_N);
    if (tile_row < rows_valid && columns > 0) {
      const int64_t row = tile.row_begin + static_cast<int64_t>(tile.m_block) * Config::BLOCK_M +
                          tile_row;
      // A row inside the expert's count always has a source (padding rows lie past it).
      const comm::RowSource source = comm::unpack_row_source(view.layout, view.row_source()[row]);
      char* destination = source.rank == view.rank
                              ? view.expert_y_row(row)
                              : view.slot_row(source.rank, source.token, source.slot);
      ptx::bulk_store(destination + static_cast<int64_t>(column_begin) * 2,
                      warp_staging + lane * kStagingPitch, static_cast<uint32_t>(columns) * 2);
    }
    ptx::bulk_commit_group();
  }
}

}  // namespace mok::megakernel
