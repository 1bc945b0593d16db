// The routed gate/up tiles read this rank's own tokens straight from the caller's x: the dispatch
// copies only the rows a peer owns into expert_x, so one rank alone copies nothing, and at EP 2 half
// the rows stay where they are.
//
// Hopper's TMA has no gather, and one TMA box per row is far too slow: 128 boxes per k-block made
// the deepseek-v3 forward 3x slower (perf-notes/layer.md v16). So a tile holding own rows has its
// A operand copied by the producer warp with cp.async, 16 bytes a lane, 4 rows of 128 bytes a warp
// instruction: own rows from x, a peer's from expert_x (its ring row), each 16-byte chunk c of row
// r written where the tile-wide TMA box with the 128-byte swizzle puts it (byte 128 r + 16 (c ^
// r % 8) of the 1024-byte-aligned stage), so the consumers' wgmma are unchanged. The copies report
// to the stage's full barrier (cp.async.mbarrier.arrive), beside the B tile's TMA bytes. A tile
// whose rows all come from peers keeps the one-box TMA load.
#pragma once

#include <cstdint>

#include "kernels/comm/workspace_layout.cuh"
#include "kernels/gemm/gemm_types.cuh"
#include "kernels/megakernel/forward_params.cuh"
#include "kernels/megakernel/task_list.cuh"
#include "kernels/ptx/barrier.cuh"
#include "kernels/ptx/cp_async.cuh"
#include "kernels/ptx/tma.cuh"

namespace mok::megakernel {

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900

inline constexpr int kGatherRowsPerLane = gemm::TileConfig::BLOCK_M / 32;

// What the producer needs to know of one routed gate/up tile before loading it.
struct RowGather {
  uint32_t dispatched_rows;  // the block's rows the dispatch copies
  bool any_from_x;           // some row is read from x: load_gathered, not the tile-wide box
};

// The whole producer warp, for a kGateUp task: row_start[r] gets where row r of the tile starts
// (k = 0); the result is the same on every lane. Rows past the expert's count repeat row 0 (their
// outputs are never stored, and reading past a buffer's end is not allowed).
__device__ inline RowGather plan_row_gather(const FusedForwardParams& params, const Task& task,
                                            int lane, const char** row_start) {
  constexpr int kRows = gemm::TileConfig::BLOCK_M;
  const comm::WorkspaceView& view = params.view;
  const int32_t* row_source = view.row_source();
  const int rows = min(kRows, task.tile.row_count - task.tile.m_block * kRows);
  const int ring_first = task.tile.row_begin + task.tile.m_block * kRows;
  const int64_t call_first = static_cast<int64_t>(task.mblock) * kRows;
  RowGather gather{0, false};
  bool any_own = false;
  const char* first = nullptr;  // row 0's start
#pragma unroll
  for (int j = 0; j < kGatherRowsPerLane; ++j) {
    const int row = lane + 32 * j;
    const char* start = nullptr;
    bool dispatched = false;
    if (row < rows) {
      const comm::RowSource source =
          comm::unpack_row_source(view.layout, row_source[call_first + row]);
      const bool own = source.rank == view.rank;
      start = own ? reinterpret_cast<const char*>(params.x) +
                        static_cast<int64_t>(source.token) * view.layout.row_bytes()
                  : view.expert_x_row(ring_first + row);
      any_own |= own;
      dispatched = !own;
    }
    if (j == 0) first = reinterpret_cast<const char*>(__shfl_sync(
                    0xffffffffu, reinterpret_cast<uintptr_t>(start), 0));
    row_start[row] = row < rows ? start : first;
    gather.dispatched_rows += __popc(__ballot_sync(0xffffffffu, dispatched));
  }
  gather.any_from_x = __any_sync(0xffffffffu, any_own);
  __syncwarp();
  return gather;
}

// The whole producer warp: streams the tile's k-blocks into the stage ring as the tile loader
// does, A by cp.async from row_start (see the header comment), B as one TMA box. The consumers
// must fence their view of the stage before their wgmma read it (Task::gathered).
__device__ inline void load_gathered(const FusedForwardMaps& maps, const Loop::Storage& smem,
                                     const gemm::GroupedGemmParams& params, const Task& task,
                                     const char* const* row_start, Loop::State& state, int lane) {
  using Config = gemm::TileConfig;
  constexpr int kRowBytes = Config::BLOCK_K * 2;  // one swizzled line
  constexpr int kChunks = kRowBytes / 16;         // 16-byte chunks per line, one per lane
  constexpr int kRowsPerStep = 32 / kChunks;      // lines one warp instruction fills
  constexpr int kSteps = Config::BLOCK_M / kRowsPerStep;  // warp instructions per k-block
  constexpr int kBatch = 8;                               // row starts read at once
  static_assert(kSteps % kBatch == 0, "whole batches");
  const int chunk = lane % kChunks;
  const int first_row = lane / kChunks;
  const int num_blocks = gemm::ceil_div(params.k, Config::BLOCK_K);
  const int row_bytes = params.k * 2;
  for (int k_block = 0; k_block < num_blocks; ++k_block) {
    ptx::mbarrier_wait(&smem.empty[state.index], state.phase ^ 1u);
    uint64_t* full = &smem.full[state.index];
    // B first, its bytes announced without arriving: the phase cannot end before the one arrival
    // below, which comes after every lane's copies are counted.
    if (lane == 0) {
      ptx::mbarrier_expect_tx(full, Config::kBBytes);
      ptx::tma_load_3d(smem.b_stage(state.index), &maps.b[static_cast<int>(TaskKind::kGateUp)],
                       full, k_block * Config::BLOCK_K, task.tile.n_block * Config::BLOCK_N,
                       task.tile.group);
    }
    const int column_bytes = k_block * kRowBytes + chunk * 16;
    // Past K (a multiple of 8 columns): zeros, as the TMA box's out-of-bounds fill.
    const uint32_t source_bytes = column_bytes < row_bytes ? 16 : 0;
    uint8_t* a = smem.a_stage(state.index);
    // The row starts of a batch are read before its copies are issued: each copy is an asm
    // statement that clobbers memory, so a read between two of them would wait out its latency.
    const int64_t offset = source_bytes != 0 ? column_bytes : 0;
#pragma unroll
    for (int batch = 0; batch < kSteps; batch += kBatch) {
      const char* source[kBatch];
#pragma unroll
      for (int i = 0; i < kBatch; ++i) source[i] = row_start[first_row + (batch + i) * kRowsPerStep];
#pragma unroll
      for (int i = 0; i < kBatch; ++i) {
        const int row = first_row + (batch + i) * kRowsPerStep;
        ptx::cp_async_16(a + row * kRowBytes + ((chunk ^ (row % 8)) * 16), source[i] + offset,
                         source_bytes);
      }
    }
    ptx::cp_async_mbarrier_arrive(full);
    __syncwarp();  // every lane's copies are counted before the one arrival can end the phase
    if (lane == 0) ptx::mbarrier_arrive(full);
    __syncwarp();
    state.advance();
  }
}

#endif  // __CUDA_ARCH__ >= 900

}  // namespace mok::megakernel
