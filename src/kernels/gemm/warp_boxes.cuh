// How the cooperative engine writes wgrad's bf16 weight gradients: one warp's 16 fragment rows at
// a time, 64 columns per tile store (TMA), so that the consumers go on to their next tile while the
// TMA unit copies the rows out.
//
// A warp's 16 staging rows (kWarpStagingBytes) hold two boxes of 16 rows x 64 bf16 columns
// (128-byte lines), in the layout a 128-byte-swizzled tensor map expects: 16-byte vector c of line
// r at vector c ^ (r % 8). That is also what keeps a fragment store (8 rows, one vector each)
// conflict-free. The boxes alternate: before a box is refilled, the store that read it two boxes
// ago must have read it (bulk_wait_group_read<1>). Weight gradients have no group tails (M and N
// are weight dimensions), and the tensor map clips the columns and rows past N and M, so every
// store is a whole box.
//
// Same values as WarpRows (the same bf16 pairs in the same places); only the way out differs.
#pragma once

#include <cuda.h>

#include <cstdint>

#include "kernels/gemm/gemm_types.cuh"
#include "kernels/gemm/warp_rows.cuh"
#include "kernels/ptx/barrier.cuh"
#include "kernels/ptx/tma.cuh"

namespace mok::gemm {

// A box, and so the box of C's tensor map: the 16 rows of a warp's fragment, 64 bf16 columns.
inline constexpr int kWarpBoxRows = 16;
inline constexpr int kWarpBoxColumns = 64;

template <int kColumns>
struct WarpBoxes {
  using Rows = WarpRows<kColumns, /*kSwiGlu=*/false>;
  static constexpr int kBoxColumns = kWarpBoxColumns;
  static constexpr int kBoxVectors = kBoxColumns / 8;  // 16-byte vectors per line
  static constexpr uint32_t kLineBytes = kBoxColumns * 2;
  static constexpr uint32_t kBoxBytes = kWarpBoxRows * kLineBytes;
  static constexpr int kBoxes = kColumns / kBoxColumns;
  static_assert(kColumns % kBoxColumns == 0, "whole boxes");
  static_assert(2 * kBoxBytes == kWarpStagingBytes, "two boxes fill a warp's staging rows");

  // packed: Rows::pack's pairs. column, row, group: the box origin of the warp's first column and
  // row in the map's coordinates (column, row of the group's C, group).
  __device__ static void write(uint8_t* warp_staging, const uint32_t (&packed)[Rows::kPacked],
                               const CUtensorMap* map, int column, int row, int group) {
    const int lane_idx = static_cast<int>(threadIdx.x % 32);
    const int quad_byte = 4 * (lane_idx % 4);
#pragma unroll
    for (int box = 0; box < kBoxes; ++box) {
      uint8_t* staging = warp_staging + (box % 2) * kBoxBytes;
      // The store of box - 2 has read it (lane 0's; the other lanes have no bulk groups).
      ptx::bulk_wait_group_read<1>();
      __syncwarp();
#pragma unroll
      for (int vector = 0; vector < kBoxVectors; ++vector) {
        const int out_vector = box * kBoxVectors + vector;
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int line = lane_idx / 4 + 8 * half;
          *reinterpret_cast<uint32_t*>(staging + line * kLineBytes + ((vector ^ (line % 8)) * 16) +
                                       quad_byte) = packed[2 * out_vector + half];
        }
      }
      ptx::fence_proxy_async_shared();  // the stores above, before the TMA unit reads them
      __syncwarp();
      // (no branch: the FP8 wgrad's next wgmma group is in flight here, Fp8Mainloop::kLookahead)
      ptx::tma_store_3d_commit_if(lane_idx == 0, map, staging, column + box * kBoxColumns, row,
                                  group);
    }
  }

  // Lane 0 of each writing warp, before the kernel ends: every store has landed.
  __device__ static void drain() {
    if (threadIdx.x % 32 == 0) ptx::bulk_wait_group<0>();
  }
};

}  // namespace mok::gemm
