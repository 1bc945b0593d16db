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

  static constexpr int kBoxPairs = 2 * kBoxVectors;  // bf16 pairs a thread holds of one box

  // packed: Rows::pack's pairs. column, row, group: the box origin of the warp's first column and
  // row in the map's coordinates (column, row of the group's C, group).
  __device__ static void write(uint8_t* warp_staging, const uint32_t (&packed)[Rows::kPacked],
                               const CUtensorMap* map, int column, int row, int group) {
    write_boxes<0, kBoxes, 0>(warp_staging, packed, map, column, row, group);
  }

  // The last kHeld boxes of a warp's rows, held in registers until the warp stores them, and
  // where they go. The cooperative wgrad stores them once the next tile's second wgmma group is
  // issued: the wait for the first boxes' reads (bulk_wait_group_read) then runs beside MMAs.
  template <int kHeld>
  struct Held {
    static_assert(kHeld > 0 && kHeld < kBoxes, "some boxes go at once, some are held");
    uint32_t pairs[kHeld * kBoxPairs];
    int column;
    int row;
    int group;
  };

  // write() of the first kBoxes - kHeld boxes; the others into `held`.
  template <int kHeld>
  __device__ static void write_holding(uint8_t* warp_staging,
                                       const uint32_t (&packed)[Rows::kPacked],
                                       const CUtensorMap* map, int column, int row, int group,
                                       Held<kHeld>& held) {
    constexpr int kNow = kBoxes - kHeld;
    write_boxes<0, kNow, 0>(warp_staging, packed, map, column, row, group);
#pragma unroll
    for (int i = 0; i < kHeld * kBoxPairs; ++i) held.pairs[i] = packed[kNow * kBoxPairs + i];
    held.column = column;
    held.row = row;
    held.group = group;
  }

  // Stores the boxes write_holding held (after it, in the same warp, with the same staging rows).
  template <int kHeld>
  __device__ static void write_held(uint8_t* warp_staging, const Held<kHeld>& held,
                                    const CUtensorMap* map) {
    constexpr int kNow = kBoxes - kHeld;
    write_boxes<kNow, kHeld, kNow * kBoxPairs>(warp_staging, held.pairs, map, held.column, held.row,
                                               held.group);
  }

  // Lane 0 of each writing warp, before the kernel ends: every store has landed.
  __device__ static void drain() {
    if (threadIdx.x % 32 == 0) ptx::bulk_wait_group<0>();
  }

 private:
  // Boxes [kFirst, kFirst + kCount) of the warp's rows, box b's pairs at
  // pairs[b * kBoxPairs - kPairOffset, + kBoxPairs), staged in the staging box b % 2.
  template <int kFirst, int kCount, int kPairOffset, int kSize>
  __device__ static void write_boxes(uint8_t* warp_staging, const uint32_t (&pairs)[kSize],
                                     const CUtensorMap* map, int column, int row, int group) {
    static_assert(kFirst * kBoxPairs - kPairOffset >= 0 &&
                      (kFirst + kCount) * kBoxPairs - kPairOffset <= kSize,
                  "the pairs hold the boxes");
    const int lane_idx = static_cast<int>(threadIdx.x % 32);
    const int quad_byte = 4 * (lane_idx % 4);
#pragma unroll
    for (int box = kFirst; box < kFirst + kCount; ++box) {
      uint8_t* staging = warp_staging + (box % 2) * kBoxBytes;
      // The store of box - 2 has read it (lane 0's; the other lanes have no bulk groups).
      ptx::bulk_wait_group_read<1>();
      __syncwarp();
#pragma unroll
      for (int vector = 0; vector < kBoxVectors; ++vector) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int line = lane_idx / 4 + 8 * half;
          *reinterpret_cast<uint32_t*>(staging + line * kLineBytes + ((vector ^ (line % 8)) * 16) +
                                       quad_byte) =
              pairs[box * kBoxPairs - kPairOffset + 2 * vector + half];
        }
      }
      ptx::fence_proxy_async_shared();  // the stores above, before the TMA unit reads them
      __syncwarp();
      // (no branch: the bf16 wgrad's next wgmma group is in flight here, for the held boxes)
      ptx::tma_store_3d_commit_if(lane_idx == 0, map, staging, column + box * kBoxColumns, row,
                                  group);
    }
  }
};

}  // namespace mok::gemm
