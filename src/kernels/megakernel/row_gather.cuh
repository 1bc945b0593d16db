// The routed gate/up tiles read this rank's own tokens straight from the caller's x: the dispatch
// copies only the rows a peer owns into expert_x, so one rank alone copies nothing, and at EP 2 half
// the rows stay where they are.
//
// Hopper's TMA has no gather, so a tile holding own rows loads its A operand one row at a time:
// per k-block, each producer lane issues the 128-byte boxes of 4 of the tile's 128 rows, from x
// (own tokens) or from expert_x (a peer's, at its ring row), into the rows of the stage the
// tile-wide box would fill. The 128-byte swizzle is a function of the shared-memory address (the
// 16-byte chunk c of the line at byte offset 128 r of a 1024-byte-aligned stage goes to c ^ r % 8),
// so the stage holds the same bytes in the same places as when the rows are contiguous, and the
// consumers' wgmma are unchanged. A tile whose rows all come from peers keeps the one-box load.
#pragma once

#include <cstdint>

#include "kernels/comm/workspace_layout.cuh"
#include "kernels/gemm/gemm_types.cuh"
#include "kernels/megakernel/forward_params.cuh"
#include "kernels/megakernel/task_list.cuh"
#include "kernels/ptx/barrier.cuh"
#include "kernels/ptx/tma.cuh"

namespace mok::megakernel {

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900

inline constexpr int kGatherRowsPerLane = gemm::TileConfig::BLOCK_M / 32;
static_assert(kGatherRowsPerLane == 4, "one int4 of rows per producer lane");

// A row of the tile, as the producer loads it: the row of x (bit 31 set: an own token) or of the
// expert_x ring.
inline constexpr uint32_t kRowFromX = 1u << 31;

// What the producer needs to know of one routed gate/up tile before loading it.
struct RowGather {
  uint32_t dispatched_rows;  // the block's rows the dispatch copies
  bool any_from_x;           // some row is read from x: load_gathered, not the tile-wide box
};

// The whole producer warp, for a kGateUp task: lane_rows[lane] gets rows lane + 32 j (j = 0..3),
// the result is the same on every lane. Rows past the expert's count are read from the ring, as
// the tile-wide box reads them: their outputs are never stored.
__device__ inline RowGather plan_row_gather(const FusedForwardParams& params, const Task& task,
                                            int lane, int4* lane_rows) {
  constexpr int kRows = gemm::TileConfig::BLOCK_M;
  const comm::WorkspaceView& view = params.view;
  const int32_t* row_source = view.row_source();
  const int rows = min(kRows, task.tile.row_count - task.tile.m_block * kRows);
  const int ring_first = task.tile.row_begin + task.tile.m_block * kRows;
  const int64_t call_first = static_cast<int64_t>(task.mblock) * kRows;
  int32_t coordinate[kGatherRowsPerLane];
  RowGather gather{0, false};
  bool any_own = false;
#pragma unroll
  for (int j = 0; j < kGatherRowsPerLane; ++j) {
    const int row = lane + 32 * j;
    coordinate[j] = ring_first + row;
    bool own = false, dispatched = false;
    if (row < rows) {
      const comm::RowSource source =
          comm::unpack_row_source(view.layout, row_source[call_first + row]);
      own = source.rank == view.rank;
      dispatched = !own;
      if (own) coordinate[j] = static_cast<int32_t>(source.token | kRowFromX);
    }
    any_own |= own;
    gather.dispatched_rows += __popc(__ballot_sync(0xffffffffu, dispatched));
  }
  lane_rows[lane] = make_int4(coordinate[0], coordinate[1], coordinate[2], coordinate[3]);
  gather.any_from_x = __any_sync(0xffffffffu, any_own);
  __syncwarp();
  return gather;
}

// The whole producer warp: streams the tile's k-blocks into the stage ring as the tile loader
// does, A row by row from lane_rows (see the header comment), B as one box.
__device__ inline void load_gathered(const FusedForwardMaps& maps, const Loop::Storage& smem,
                                     const gemm::GroupedGemmParams& params, const Task& task,
                                     const int4* lane_rows, Loop::State& state, int lane) {
  using Config = gemm::TileConfig;
  constexpr int kRowBytes = Config::BLOCK_K * 2;  // one swizzled line
  const int num_blocks = gemm::ceil_div(params.k, Config::BLOCK_K);
  for (int k_block = 0; k_block < num_blocks; ++k_block) {
    ptx::mbarrier_wait(&smem.empty[state.index], state.phase ^ 1u);
    uint64_t* full = &smem.full[state.index];
    const int k = k_block * Config::BLOCK_K;
    if (lane == 0) {
      ptx::mbarrier_arrive_expect_tx(full, Config::kStageBytes);
      ptx::tma_load_3d(smem.b_stage(state.index), &maps.b[static_cast<int>(TaskKind::kGateUp)],
                       full, k, task.tile.n_block * Config::BLOCK_N, task.tile.group);
    }
    __syncwarp();
    const int4 rows = lane_rows[lane];  // reloaded each k-block: no registers held across it
    const int32_t coordinate[kGatherRowsPerLane] = {rows.x, rows.y, rows.z, rows.w};
    uint8_t* a = smem.a_stage(state.index) + lane * kRowBytes;
#pragma unroll
    for (int j = 0; j < kGatherRowsPerLane; ++j) {
      const uint32_t packed = static_cast<uint32_t>(coordinate[j]);
      const bool from_x = (packed & kRowFromX) != 0;
      ptx::tma_load_2d(a + 32 * j * kRowBytes, from_x ? &maps.x_rows : &maps.expert_x_rows, full,
                       k, static_cast<int32_t>(packed & ~kRowFromX));
    }
    __syncwarp();
    state.advance();
  }
}

#endif  // __CUDA_ARCH__ >= 900

}  // namespace mok::megakernel
