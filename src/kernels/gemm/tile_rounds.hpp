// The order in which the persistent GEMM kernels' CTAs take linear tiles: in rounds of one tile
// per CTA (or cluster), round r holding tiles r * grid .. r * grid + grid - 1. One definition for
// the tile scheduler (tile_scheduler.cuh) and the host tests.
//
// Taking tile b of every round, CTA b holds the same place in every group whose tile count per N
// block divides the grid (an expert of 2 or 3 row blocks at 132 SMs: its last, often half, tile
// always on the same CTAs). Rotated rounds give CTA b tile (b + r * step) mod grid of round r,
// with grid + step prime to 2 and 3, so that its place in such a group moves from round to round.
// Each round stays a permutation of its tiles: every tile is taken once, a round's tiles still run
// side by side (the same L2 locality), and each CTA's tile indices still increase.
#pragma once

#include "mok/detail/numerics.hpp"

namespace mok::gemm {

// The least step >= 1 with grid + step prime to 6 (1 at 132 SMs).
MOK_HOST_DEVICE int rotation_step(int grid) {
  int step = 1;
  while ((grid + step) % 2 == 0 || (grid + step) % 3 == 0) ++step;
  return step;
}

// The linear tile CTA (or cluster) `block` of `grid` takes in round `round`; step 0 gives tile
// block of every round.
MOK_HOST_DEVICE int round_tile(int round, int block, int grid, int step) {
  return round * grid + (block + round * step) % grid;
}

}  // namespace mok::gemm
