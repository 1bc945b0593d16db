// How the FP8 wgrad writes its bf16 weight gradients: the consumer warps stage the whole tile in
// shared memory and a store warp of the producer warpgroup copies it out by TMA, so that the
// consumers go on to the next tile's MMAs as soon as their rows are staged.
//
// The staging holds kBoxes boxes of (kRows, 64) bf16 (128-byte lines), in the layout a
// 128-byte-swizzled tensor map expects: 16-byte vector c of line r at vector c ^ (r % 8), which
// also keeps a fragment store (8 lines, one vector each) conflict-free. Per tile:
//   consumers   wait `free` (the store warp has read the previous tile's boxes), each warp writes
//               its 16 lines of every box, fences them for the async proxy and arrives on `staged`
//   store warp  waits `staged`, issues one TMA store per box, waits until they have read the
//               staging, arrives on `free`
// Same values as WarpBoxes and WarpRows (the same bf16 pairs in the same places); only the way out
// differs. Weight gradients have no group tails, and the tensor map clips the rows and columns
// past M and N, so every store is a whole box.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/ptx/barrier.cuh"
#include "kernels/ptx/tma.cuh"

namespace mok::gemm {

template <int kRows, int kColumns>
struct TileBoxes {
  static constexpr int kBoxColumns = 64;
  static constexpr int kBoxVectors = kBoxColumns / 8;  // 16-byte vectors per line
  static constexpr uint32_t kLineBytes = kBoxColumns * 2;
  static constexpr uint32_t kBoxBytes = kRows * kLineBytes;
  static constexpr int kBoxes = kColumns / kBoxColumns;
  static constexpr uint32_t kBytes = kBoxes * kBoxBytes;  // 1024-aligned boxes: the swizzle's
  static constexpr uint32_t kWritingWarps = kRows / 16;   // arrivals on `staged`
  static_assert(kColumns % kBoxColumns == 0 && kRows % 16 == 0 && kBoxBytes % 1024 == 0,
                "whole boxes of whole warps, each on the swizzle's 1024-byte period");

  struct Staging {
    uint8_t* boxes;    // (kBoxes, kRows, kBoxColumns) bf16, swizzled
    uint64_t* staged;  // kWritingWarps arrivals: the tile's boxes are in shared memory
    uint64_t* free;    // 1 arrival: the store warp's TMA stores have read them
  };

  __device__ static void init_barriers(const Staging& staging) {
    ptx::mbarrier_init(staging.staged, kWritingWarps);
    ptx::mbarrier_init(staging.free, 1);
  }

  // Consumer threads, before writing the staging for the `stored`-th time (0 for the kernel's
  // first tile): the store warp has read what they staged before. A spin loop (its trap out of
  // line, for the consumers' registers): call it where no wgmma group is in flight (ptxas would
  // wait for the group before the branch).
  __device__ static void wait_free(const Staging& staging, uint32_t stored) {
    ptx::mbarrier_wait_trap_out_of_line(staging.free, (stored & 1u) ^ 1u);
  }

  // A consumer warp's 16 rows (its first at tile row warp_first_row, a multiple of 16) from its
  // (16, kColumns) slice of wgmma's fragment (accum[0, kColumns / 2)), rounded to bf16 pairs as
  // WarpRows::pack rounds them, one box at a time. No branch, so that a
  // wgmma group may stay in flight across it (the FP8 wgrad's lookahead).
  template <int kSize>
  __device__ static void stage(const Staging& staging, const float (&accum)[kSize],
                               int warp_first_row) {
    static_assert(kColumns / 2 <= kSize, "the accumulators hold the columns");
    const int lane_idx = static_cast<int>(threadIdx.x % 32);
    // The warp's lines start on the swizzle's 8-line period, so a line's swizzle is that of its
    // place among the warp's (and each address a constant offset from the warp's first line).
    uint8_t* warp_lines = staging.boxes + warp_first_row * kLineBytes + 4 * (lane_idx % 4);
#pragma unroll
    for (int box = 0; box < kBoxes; ++box) {
#pragma unroll
      for (int vector = 0; vector < kBoxVectors; ++vector) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          // Fragment block j's pair (4 j + 2 half, + 1): columns 8 j + 2 (lane % 4), + 1 of
          // line lane / 4 + 8 half.
          const int index = 4 * (box * kBoxVectors + vector) + 2 * half;
          const __nv_bfloat162 pair = __floats2bfloat162_rn(accum[index], accum[index + 1]);
          const int line = lane_idx / 4 + 8 * half;  // among the warp's 16
          *reinterpret_cast<__nv_bfloat162*>(warp_lines + box * kBoxBytes + line * kLineBytes +
                                             ((vector ^ (line % 8)) * 16)) = pair;
        }
      }
    }
    ptx::fence_proxy_async_shared();  // the stores above, before the TMA unit reads them
    __syncwarp();
    ptx::mbarrier_arrive_if(lane_idx == 0, staging.staged);
  }

  // The store warp (all 32 lanes), for its `stored`-th tile: the tile's boxes to C at (column,
  // row, group), the map's box (kBoxColumns, kRows, 1).
  __device__ static void store(const Staging& staging, uint32_t stored, const CUtensorMap* map,
                               int column, int row, int group) {
    ptx::mbarrier_wait_trap_out_of_line(staging.staged, stored & 1u);
    if (threadIdx.x % 32 == 0) {
#pragma unroll
      for (int box = 0; box < kBoxes; ++box) {
        ptx::tma_store_3d_commit_if(true, map, staging.boxes + box * kBoxBytes,
                                    column + box * kBoxColumns, row, group);
      }
      ptx::bulk_wait_group_read<0>();
      ptx::mbarrier_arrive(staging.free);
    }
    __syncwarp();
  }

  // The store warp, after its last tile: every store has landed.
  __device__ static void drain() {
    if (threadIdx.x % 32 == 0) ptx::bulk_wait_group<0>();
  }
};

}  // namespace mok::gemm
