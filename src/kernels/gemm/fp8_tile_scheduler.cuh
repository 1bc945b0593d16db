// The FP8 kernel's tiles: the grouped tile scheduler's (tile_scheduler.cuh), on clusters
// (kFp8ClusterSize) with an expert's M blocks taken kClusterSize at a time, so that a cluster's
// CTAs always share the group (hence the k-blocks) and the weight tile, which they load by TMA
// multicast.
//
// An M block past the group's rows (an odd block count) is an empty tile (fp8_is_empty_tile): its
// CTA still loads its share of the weight tile and consumes its stages, and stores nothing. What
// is computed for a row never depends on the tile it falls in, so the results are those of
// single CTAs, bitwise, whatever the grid.
#pragma once

#include "kernels/gemm/fp8_gemm_types.cuh"
#include "kernels/gemm/tile_scheduler.cuh"

namespace mok::gemm {

// A forward tile whose M block starts past its group's rows (only on clusters).
__host__ __device__ inline bool fp8_is_empty_tile(const GroupedTile& tile) {
  return tile.mblock * Fp8TileConfig::BLOCK_M >= tile.row_count;
}

// Whether the tile's consumers split its columns (tile_scheduler.cuh's is_half_tile: a group's
// last M block of at most 64 rows). kSwiGluFp8 never does: its gate and up pieces must meet in one
// consumer, so a short last block runs whole, its rows past the group computed and not stored.
template <GemmKind kKind, EpilogueKind kEpilogue>
__host__ __device__ inline bool fp8_is_half_tile(const GroupedTile& tile) {
  return kEpilogue != EpilogueKind::kSwiGluFp8 && is_half_tile<kKind>(tile);
}

template <GemmKind kKind, int kClusterSize>
using Fp8Scheduler = GroupedTileScheduler<kKind, Fp8TileConfig, kClusterSize,
                                          /*kRotateRounds=*/kClusterSize == 1,
                                          /*kGroupRange=*/false>;

}  // namespace mok::gemm
