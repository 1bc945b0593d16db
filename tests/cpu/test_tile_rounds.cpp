// The GEMM kernels' tile order (kernels/gemm/tile_rounds.hpp), on the host: every tile taken once,
// each CTA's tiles in increasing order, and rotated rounds moving a CTA's place in groups whose
// tile counts divide the grid.
#include <gtest/gtest.h>

#include <vector>

#include "kernels/gemm/tile_rounds.hpp"

namespace mok::gemm {
namespace {

TEST(TileRounds, StepMakesTheRoundLengthPrimeToSix) {
  EXPECT_EQ(rotation_step(132), 1);  // the H200's SMs: the order measured in perf notes
  for (int grid = 1; grid <= 1000; ++grid) {
    const int step = rotation_step(grid);
    ASSERT_GE(step, 1) << grid;
    EXPECT_TRUE((grid + step) % 2 != 0 && (grid + step) % 3 != 0) << grid;
    for (int smaller = 1; smaller < step; ++smaller) {
      EXPECT_TRUE((grid + smaller) % 2 == 0 || (grid + smaller) % 3 == 0) << grid;
    }
  }
}

// Each CTA takes round_tile(r, b, ...) for r = 0, 1, ... while it is below `tiles` (the
// scheduler's loop); every tile must be taken exactly once, each CTA's in increasing order.
void expect_every_tile_once(int grid, int tiles, int step) {
  std::vector<int> taken(static_cast<size_t>(tiles), 0);
  for (int block = 0; block < grid; ++block) {
    int previous = -1;
    for (int round = 0;; ++round) {
      const int tile = round_tile(round, block, grid, step);
      if (tile >= tiles) break;
      ASSERT_GT(tile, previous) << "grid " << grid << " CTA " << block << " round " << round;
      previous = tile;
      ++taken[static_cast<size_t>(tile)];
    }
  }
  for (int tile = 0; tile < tiles; ++tile) {
    ASSERT_EQ(taken[static_cast<size_t>(tile)], 1)
        << "grid " << grid << ", " << tiles << " tiles, step " << step << ": tile " << tile;
  }
}

TEST(TileRounds, EveryTileOnceInIncreasingOrder) {
  for (int grid = 1; grid <= 300; ++grid) {
    for (const int tiles : {0, 1, grid - 1, grid, grid + 1, 5 * grid + 3, 997}) {
      if (tiles < 0) continue;
      expect_every_tile_once(grid, tiles, 0);
      expect_every_tile_once(grid, tiles, rotation_step(grid));
    }
  }
}

// The share of rounds in which CTA `block` takes a tile at place period - 1 of a pattern of
// `period` tiles (an expert's last row block, when it has `period` row blocks).
double share_on_last_place(int block, int grid, int step, int period, int rounds) {
  int on_last = 0;
  for (int round = 0; round < rounds; ++round) {
    on_last += round_tile(round, block, grid, step) % period == period - 1;
  }
  return static_cast<double>(on_last) / rounds;
}

TEST(TileRounds, RotatedRoundsMoveEachCtasPlace) {
  constexpr int kRounds = 60;
  for (const int grid : {2, 3, 7, 44, 66, 131, 132, 133, 264}) {
    for (const int period : {2, 3, 6}) {
      for (int block = 0; block < grid; ++block) {
        const double share = share_on_last_place(block, grid, rotation_step(grid), period, kRounds);
        EXPECT_NEAR(share, 1.0 / period, 0.05)
            << "grid " << grid << ", period " << period << ", CTA " << block;
      }
    }
  }
  // Without rotation, at 132 CTAs, CTA 131 takes the last place of every such pattern in every
  // round, and CTA 0 never does: what the rotation is for.
  for (const int period : {2, 3, 6}) {
    EXPECT_EQ(share_on_last_place(131, 132, 0, period, kRounds), 1.0) << period;
    EXPECT_EQ(share_on_last_place(0, 132, 0, period, kRounds), 0.0) << period;
  }
}

}  // namespace
}  // namespace mok::gemm
