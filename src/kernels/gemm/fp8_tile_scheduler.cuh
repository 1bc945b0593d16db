// The FP8 forward's tiles on clusters (kFp8ClusterSize): the grouped tile scheduler's order, with
// an expert's M blocks taken kClusterSize at a time. Cluster c walks cluster tiles c, c +
// num_clusters, ...; the tiles of group g follow those of g - 1, M inner, and CTA r of the cluster
// takes M block kClusterSize * p + r of the cluster tile's M group p at its N block. So a cluster's
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

template <int kClusterSize>
class Fp8ClusterTileScheduler {
 public:
  using Config = Fp8TileConfig;

  __device__ explicit Fp8ClusterTileScheduler(const GroupedGemmParams& params)
      : offsets_(params.group_offsets),
        counts_(params.group_counts),
        num_groups_(params.num_groups),
        num_n_blocks_(ceil_div(params.n, Config::BLOCK_N)),
        tile_idx_(static_cast<int>(blockIdx.x) / kClusterSize),
        cluster_rank_(static_cast<int>(blockIdx.x) % kClusterSize) {
    load_group(0);
  }

  // Fills `tile` with this CTA's next tile; false when its cluster has none left.
  __device__ bool next_tile(GroupedTile& tile) {
    while (group_ < num_groups_ && tile_idx_ >= group_first_tile_ + group_num_tiles_) {
      group_first_tile_ += group_num_tiles_;
      load_group(group_ + 1);
    }
    if (group_ >= num_groups_) return false;
    const int local_idx = tile_idx_ - group_first_tile_;
    tile = {group_, (local_idx % num_m_groups_) * kClusterSize + cluster_rank_,
            local_idx / num_m_groups_, row_begin_, row_count_};
    tile_idx_ += static_cast<int>(gridDim.x) / kClusterSize;
    return true;
  }

 private:
  __device__ void load_group(int group) {
    group_ = group;
    if (group >= num_groups_) return;
    row_begin_ = offsets_[group];
    row_count_ = counts_ != nullptr ? counts_[group] : offsets_[group + 1] - row_begin_;
    num_m_groups_ = ceil_div(ceil_div(row_count_, Config::BLOCK_M), kClusterSize);
    group_num_tiles_ = num_m_groups_ * num_n_blocks_;
  }

  const int* offsets_;
  const int* counts_;
  int num_groups_;
  int num_n_blocks_;
  int tile_idx_;      // of this CTA's cluster, among the clusters' tiles
  int cluster_rank_;  // blockIdx.x % kClusterSize: a cluster's CTAs are consecutive blocks
  int group_ = 0;
  int group_first_tile_ = 0;
  int group_num_tiles_ = 0;
  int num_m_groups_ = 0;
  int row_begin_ = 0;
  int row_count_ = 0;
};

}  // namespace mok::gemm
