// The routed gate/up tiles read this rank's own tokens straight from the caller's x: the dispatch
// copies only the rows a peer owns into expert_x, so one rank alone copies nothing, and at EP 2 half
// the rows stay where they are.
//
// Hopper's TMA has no gather, and one TMA box per row is far too slow: 128 boxes per k-block made
// the deepseek-v3 forward 3x slower (perf-notes/layer.md v16). So a tile holding own rows has its
// A operand copied with cp.async by the producer warpgroup's four warps, 32 rows each, 16 bytes a
// lane, 4 rows of 128 bytes a warp instruction: own rows from x, a peer's from expert_x (its ring
// row), each 16-byte chunk c of row r written where the tile-wide TMA box with the 128-byte swizzle
// puts it (byte 128 r + 16 (c ^ r % 8) of the 1024-byte-aligned stage), so the consumers' wgmma
// are unchanged. Each warp's copies report to the stage's full barrier (cp.async.mbarrier.arrive)
// before the warp arrives on it, beside the B tile's TMA bytes; the barrier expects one arrival per
// producer warp, which the three helper warps also give for tiles they do not gather. A tile whose
// rows all come from peers keeps the one-box TMA load.
#pragma once

#include <cstdint>

#include "kernels/comm/workspace_layout.cuh"
#include "kernels/gemm/gemm_types.cuh"
#include "kernels/megakernel/forward_params.cuh"
#include "kernels/megakernel/handoff.cuh"
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

inline constexpr int kProducerWarps = 4;  // the producer warpgroup
inline constexpr int kGatherRowsPerWarp = gemm::TileConfig::BLOCK_M / kProducerWarps;

// One producer warp's share of a gathered k-block: rows [32 warp, 32 warp + 32) of the tile into
// the stage's A, counted on `full` (cp.async.mbarrier.arrive) before the caller's arrival.
__device__ inline void gather_rows(uint8_t* a_stage, uint64_t* full, const char* const* row_start,
                                   int k_block, int row_bytes, int warp, int lane) {
  using Config = gemm::TileConfig;
  constexpr int kRowBytes = Config::BLOCK_K * 2;  // one swizzled line
  constexpr int kChunks = kRowBytes / 16;         // 16-byte chunks per line, one per lane
  constexpr int kRowsPerStep = 32 / kChunks;      // lines one warp instruction fills
  constexpr int kSteps = kGatherRowsPerWarp / kRowsPerStep;  // warp instructions per k-block
  const int chunk = lane % kChunks;
  const int first_row = warp * kGatherRowsPerWarp + lane / kChunks;
  const int column_bytes = k_block * kRowBytes + chunk * 16;
  // Past K (a multiple of 8 columns): zeros, as the TMA box's out-of-bounds fill.
  const uint32_t source_bytes = column_bytes < row_bytes ? 16 : 0;
  const int64_t offset = source_bytes != 0 ? column_bytes : 0;
  // Every row start is read before the copies are issued: each copy is an asm statement that
  // clobbers memory, so a read between two of them would wait out its latency (measured: ~80
  // cycles a copy).
  const char* source[kSteps];
#pragma unroll
  for (int step = 0; step < kSteps; ++step) source[step] = row_start[first_row + step * kRowsPerStep];
#pragma unroll
  for (int step = 0; step < kSteps; ++step) {
    const int row = first_row + step * kRowsPerStep;
    ptx::cp_async_16(a_stage + row * kRowBytes + ((chunk ^ (row % 8)) * 16), source[step] + offset,
                     source_bytes);
  }
  ptx::cp_async_mbarrier_arrive(full);
  __syncwarp();  // every lane's copies are counted before the warp's arrival can end the phase
}

// Producer warp 0: streams a gathered tile's k-blocks into the stage ring as the tile loader does,
// B as one TMA box, A its share of the rows (gather_rows; the helpers copy the rest).
__device__ inline void load_gathered(const FusedForwardMaps& maps, const Loop::Storage& smem,
                                     const gemm::GroupedGemmParams& params, const Task& task,
                                     const char* const* row_start, Loop::State& state, int lane) {
  using Config = gemm::TileConfig;
  const int num_blocks = gemm::ceil_div(params.k, Config::BLOCK_K);
  for (int k_block = 0; k_block < num_blocks; ++k_block) {
    ptx::mbarrier_wait(&smem.empty[state.index], state.phase ^ 1u);
    uint64_t* full = &smem.full[state.index];
    // B's bytes announced without arriving: the phase cannot end before the four warps' arrivals,
    // each after its copies are counted.
    if (lane == 0) {
      ptx::mbarrier_expect_tx(full, Config::kBBytes);
      ptx::tma_load_3d(smem.b_stage(state.index), &maps.b[static_cast<int>(TaskKind::kGateUp)],
                       full, k_block * Config::BLOCK_K, task.tile.n_block * Config::BLOCK_N,
                       task.tile.group);
    }
    gather_rows(smem.a_stage(state.index), full, row_start, k_block, params.k * 2, 0, lane);
    if (lane == 0) ptx::mbarrier_arrive(full);
    __syncwarp();
    state.advance();
  }
}

// Producer warps 1-3: follow the tasks through the hand-off ring; for every k-block of every task
// wait for the stage, copy their share of a gathered tile's rows, and arrive on its full barrier.
__device__ inline void help_gather(const FusedForwardParams& params, const Loop::Storage& smem,
                                   TaskRing& handoff, int warp, int lane) {
  Loop::State state;
  int slot = 0;
  uint32_t slot_phase = 0;
  for (;;) {
    ptx::mbarrier_wait(&handoff.full[slot], slot_phase);
    const Task task = handoff.task[slot];
    __syncwarp();
    if (task.mblock == kNoTask) {
      if (lane == 0) ptx::mbarrier_arrive(&handoff.empty[slot]);
      break;
    }
    const gemm::GroupedGemmParams& gemm_params = params.gemm[static_cast<int>(task.kind)];
    const int num_blocks = Loop::num_k_blocks(gemm_params, task.tile);
    for (int k_block = 0; k_block < num_blocks; ++k_block) {
      ptx::mbarrier_wait(&smem.empty[state.index], state.phase ^ 1u);
      uint64_t* full = &smem.full[state.index];
      if (task.gathered) {
        gather_rows(smem.a_stage(state.index), full, handoff.gather_rows[slot], k_block,
                    gemm_params.k * 2, warp, lane);
      }
      if (lane == 0) ptx::mbarrier_arrive(full);
      __syncwarp();
      state.advance();
    }
    if (lane == 0) ptx::mbarrier_arrive(&handoff.empty[slot]);  // done with its gather rows too
    if (++slot == kTaskSlots) {
      slot = 0;
      slot_phase ^= 1u;
    }
  }
}

#endif  // __CUDA_ARCH__ >= 900

}  // namespace mok::megakernel
