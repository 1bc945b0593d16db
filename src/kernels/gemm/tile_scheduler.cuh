// Persistent tile scheduler over expert segments. The linear tiles run in rounds of one per CTA
// (tile_rounds.hpp): CTA b takes tile b of each round, or, on single CTAs (kRotateRounds), rounds
// rotated over the CTAs; the tiles of group g follow those of g - 1, and a group's
// tile count comes from its row count, read from device memory. The producer and the consumers of a
// CTA each run their own copy and see the same sequence, so they need no handshake beyond the stage
// barriers.
//
// The tile a CTA gets never changes what is computed for it (no split-K), so the results are
// bitwise independent of the grid size. Config gives the tile size: the cooperative engine's
// (128, 256) TileConfig, or the ping-pong engine's PingpongConfig.
#pragma once

#include "kernels/gemm/gemm_types.cuh"
#include "kernels/gemm/tile_rounds.hpp"

namespace mok::gemm {

struct GroupedTile {
  int group;
  int mblock;
  int n_block;
  int row_begin;  // first row of the group in the row-indexed tensors
  int row_count;  // rows of the group
};

// Where a tile of Config's size lands in C, for either engine's epilogue.
struct TileInC {
  char* tile_base;       // C element (0, 0) of the tile
  int64_t row_stride;    // bytes between C rows
  int64_t column_bytes;  // of the tile's first column within a C row
  int rows_valid;        // rows of C in the tile (the rest are past the group, or past M)
  int columns_valid;     // columns of C from the tile's first (past N when <= 0)
};

// A half tile: a cooperative (128, 256) tile of a row-indexed GEMM (forward, dgrad) whose row
// block holds at most 64 of its group's rows — the last block of a group, which the 128-row
// blocks otherwise fill with padding. Both consumer warpgroups then take rows 0-63, each one half
// of the columns (wgmma m64n128 instead of m64n256), so the padding rows cost no MMA. Each output
// element's sum is the same (same k order and k16 steps; wgmma's N does not change an element).
template <GemmKind kKind>
__host__ __device__ inline bool is_half_tile(const GroupedTile& tile) {
  if constexpr (kKind == GemmKind::kWgrad) {
    return false;  // M is a weight dimension: no group tails
  } else {
    return tile.row_count - tile.mblock * TileConfig::BLOCK_M <= TileConfig::BLOCK_M / 2;
  }
}

template <GemmKind kKind, EpilogueKind kEpilogue, class Config>
__host__ __device__ inline TileInC tile_in_c(const GroupedGemmParams& params,
                                             const GroupedTile& tile) {
  constexpr int kElementBytes = output_element_bytes(kEpilogue);
  const int output_columns =
      kEpilogue == EpilogueKind::kSwiGluBf16 || kEpilogue == EpilogueKind::kSwiGluFp8 ? params.n / 2
                                                                                      : params.n;
  const int column_begin = tile.n_block * output_tile_columns<Config>(kEpilogue);
  TileInC place;
  place.columns_valid = output_columns - column_begin;
  place.row_stride = static_cast<int64_t>(output_columns) * kElementBytes;
  int64_t first_row;
  if constexpr (kKind == GemmKind::kWgrad) {
    place.rows_valid = params.m - tile.mblock * Config::BLOCK_M;
    first_row = static_cast<int64_t>(tile.group) * params.m + tile.mblock * Config::BLOCK_M;
  } else {
    place.rows_valid = tile.row_count - tile.mblock * Config::BLOCK_M;
    first_row = tile.row_begin + static_cast<int64_t>(tile.mblock) * Config::BLOCK_M;
  }
  place.column_bytes = static_cast<int64_t>(column_begin) * kElementBytes;
  place.tile_base =
      static_cast<char*>(params.output) + first_row * place.row_stride + place.column_bytes;
  return place;
}

// Where row `tile_row` of a forward or dgrad tile placed by tile_in_c starts in C (its first
// column): row-major from tile_base, or, with output_rows (GroupedGemmParams::output_rows), row
// output_rows[r] of C (`output`) for the call's row r.
template <class Config>
__device__ inline char* tile_row_in_c(const TileInC& place, const GroupedTile& tile, int tile_row,
                                      const int32_t* output_rows, void* output) {
  if (output_rows == nullptr) return place.tile_base + tile_row * place.row_stride;
  const int64_t row =
      tile.row_begin + static_cast<int64_t>(tile.mblock) * Config::BLOCK_M + tile_row;
  return static_cast<char*>(output) + static_cast<int64_t>(output_rows[row]) * place.row_stride +
         place.column_bytes;
}

// kClusterSize > 1: the CTAs of a cluster walk the cluster's tiles together, CTA r taking M block
// kClusterSize * p + r of the tile's M group p at one N block, so that they share the group (hence
// the k-blocks) and the B tile. An M block past M, or past the group's rows (a count that is not a
// multiple), is computed or skipped by the kernel but never stored.
// kRotateRounds: rounds rotate (tile_rounds.hpp), on single CTAs only; the cooperative engines'
// (bf16 and FP8) were measured faster so, the ping-pong engine's not (perf-notes/backward.md).
// kGroupRange: honours GroupedGemmParams::group_range (the bf16 engines); the FP8 engine's
// launchers refuse a range, and its kernels leave it out (their register budget had no room).
template <GemmKind kKind, class Config = TileConfig, int kClusterSize = 1,
          bool kRotateRounds = kClusterSize == 1, bool kGroupRange = true>
class GroupedTileScheduler {
 public:
  static constexpr bool kRowsAreM = kKind != GemmKind::kWgrad;
  static constexpr bool kRotate = kRotateRounds && kClusterSize == 1;

  __device__ explicit GroupedTileScheduler(const GroupedGemmParams& params)
      : offsets_(params.group_offsets),
        counts_(params.group_counts),
        num_groups_(params.num_groups),
        num_n_blocks_(ceil_div(params.n, Config::BLOCK_N)),
        num_fixed_m_blocks_(
            kRowsAreM ? 0 : ceil_div(ceil_div(params.m, Config::BLOCK_M), kClusterSize)),
        tile_idx_(static_cast<int>(blockIdx.x) / kClusterSize),
        rotation_step_(kRotate ? rotation_step(static_cast<int>(gridDim.x)) : 0),
        cluster_rank_(static_cast<int>(blockIdx.x) % kClusterSize) {
    int first = 0;
    // A range of the groups: the tiles are theirs alone.
    if (kGroupRange && params.group_range != nullptr) {
      first = max(params.group_range[0], 0);
      num_groups_ = min(params.group_range[1], num_groups_);
    }
    load_group(first);
  }

  // Whether next_tile will find one.
  __device__ bool has_next_tile() {
    while (group_ < num_groups_ && tile_idx_ >= group_first_tile_ + group_num_tiles_) {
      group_first_tile_ += group_num_tiles_;
      load_group(group_ + 1);
    }
    return group_ < num_groups_;
  }

  // Fills `tile` with this CTA's next tile; false when there is none left.
  __device__ bool next_tile(GroupedTile& tile) {
    if (!has_next_tile()) return false;
    const int local_idx = tile_idx_ - group_first_tile_;
    if constexpr (kRowsAreM) {
      // M blocks inner: the CTAs running side by side share one weight tile through L2.
      const int num_m_groups = ceil_div(ceil_div(row_count_, Config::BLOCK_M), kClusterSize);
      tile = {group_, (local_idx % num_m_groups) * kClusterSize + cluster_rank_,
              local_idx / num_m_groups, row_begin_, row_count_};
    } else {
      tile = {group_, (local_idx / num_n_blocks_) * kClusterSize + cluster_rank_,
              local_idx % num_n_blocks_, row_begin_, row_count_};
    }
    ++round_;
    tile_idx_ = round_tile(round_, static_cast<int>(blockIdx.x) / kClusterSize,
                           static_cast<int>(gridDim.x) / kClusterSize, rotation_step_);
    return true;
  }

 private:
  __device__ void load_group(int group) {
    group_ = group;
    if (group >= num_groups_) return;
    row_begin_ = offsets_[group];
    row_count_ = counts_ != nullptr ? counts_[group] : offsets_[group + 1] - row_begin_;
    // A negative count: the group is not part of this call (a chunk of the experts: GroupedShape's
    // expert_counts), so no tile at all, not even a wgrad's zeros.
    const bool absent = row_count_ < 0;
    if (absent) row_count_ = 0;
    const int num_m_groups = absent ? 0
                             : kRowsAreM
                                 ? ceil_div(ceil_div(row_count_, Config::BLOCK_M), kClusterSize)
                                 : num_fixed_m_blocks_;
    group_num_tiles_ = num_m_groups * num_n_blocks_;
  }

  const int* offsets_;
  const int* counts_;
  int num_groups_;
  int num_n_blocks_;
  int num_fixed_m_blocks_;  // wgrad: M groups of kClusterSize M blocks (M is fixed)
  int tile_idx_;            // of this CTA's cluster, among the clusters' tiles
  int rotation_step_;       // tile_rounds.hpp; 0: no rotation
  int round_ = 0;           // tiles taken so far
  int cluster_rank_;        // blockIdx.x % kClusterSize: a cluster's CTAs are consecutive blocks
  int group_ = 0;
  int group_first_tile_ = 0;
  int group_num_tiles_ = 0;
  int row_begin_ = 0;
  int row_count_ = 0;
};

}  // namespace mok::gemm
