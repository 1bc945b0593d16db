// What a grouped GEMM computes, and the tile and shared-memory layout of the Hopper engine; one
// set of definitions for the host launcher and the device code.
//
// Every mode is normalised to C[M, N] = A[M, K] · B[K, N] per group (expert):
//   forward  Y_e  = X_e · W_eᵀ   M = rows of e (variable), N = out features, K = in features
//   dgrad    dX_e = dY_e · W_e   M = rows of e (variable), N = in features,  K = out features
//   wgrad    dW_e = dY_eᵀ · X_e  M = out features,         N = in features,  K = rows of e
// The rows of group g are group_offsets[g] .. group_offsets[g + 1] of the row-indexed tensors,
// read from device memory by the kernel only.
#pragma once

#include <cstdint>

#include "kernels/gemm/gemm_kind.hpp"
#include "mok/shape.hpp"

namespace mok::gemm {

// SwiGLU interleave: fused weight row f holds gate row (f / 16) * 8 + f % 8 when f % 16 < 8, else
// that up row. A 256-column tile thus holds 128 matching gate/up pairs in one thread's registers.
constexpr int kSwiGluInterleave = 8;
// kSwiGluFp8's interleave: fused weight rows 256 b .. 256 b + 127 are gate rows 128 b .., the next
// 128 the same up rows. A 256-column tile holds one 128-block of h per row; gate column c and up
// column c + 128 sit in one thread's registers, and each 128 x 128 weight block is W_gate's or
// W_up's alone.
constexpr int kSwiGluFp8Interleave = 128;

// A CTA tile of (kBlockM, kBlockN) outputs, k-blocks of 64, a producer warpgroup and two consumer
// warpgroups: what both engines' loaders, schedulers and layouts need of it.
template <int kBlockM, int kBlockN>
struct TileShape {
  static constexpr int BLOCK_M = kBlockM;
  static constexpr int BLOCK_N = kBlockN;
  static constexpr int BLOCK_K = 64;  // one 128-byte swizzle row of bf16
  static constexpr int kNumConsumerWarpgroups = 2;
  static constexpr int kNumThreads = 128 * (1 + kNumConsumerWarpgroups);
  static constexpr int kPanel = 64;  // MN-major tiles are loaded as 64-wide panels
  static constexpr uint32_t kPanelBytes = kPanel * BLOCK_K * 2;  // (BLOCK_K, 64) bf16
  static constexpr uint32_t kABytes = BLOCK_M * BLOCK_K * 2;     // (BLOCK_M, BLOCK_K) bf16
  static constexpr uint32_t kBBytes = BLOCK_N * BLOCK_K * 2;     // (BLOCK_N, BLOCK_K) bf16
  static constexpr uint32_t kStageBytes = kABytes + kBBytes;
};

// The cooperative engine's tile: both consumer warpgroups share it, 64 rows each. Its height is the
// layer's row block (mok/shape.hpp), which the ring sizes and the padding of each expert's rows
// follow.
struct TileConfig : TileShape<static_cast<int>(kRowBlock), 256> {};

// bf16 results leave through a shared-memory staging tile, so that whole rows are stored at a
// time; fp32 results are stored from registers.
__host__ __device__ constexpr bool uses_staged_store(EpilogueKind epilogue) {
  return epilogue == EpilogueKind::kStoreBf16 || epilogue == EpilogueKind::kSwiGluBf16;
}

// Bytes of one C element, and C columns of a tile BLOCK_N wide (SwiGLU halves them).
__host__ __device__ constexpr int output_element_bytes(EpilogueKind epilogue) {
  return epilogue == EpilogueKind::kSwiGluFp8 ? 1 : uses_staged_store(epilogue) ? 2 : 4;
}
template <class Config>
__host__ __device__ constexpr int output_tile_columns(EpilogueKind epilogue) {
  return epilogue == EpilogueKind::kSwiGluBf16 || epilogue == EpilogueKind::kSwiGluFp8
             ? Config::BLOCK_N / 2
             : Config::BLOCK_N;
}

// bf16 outputs leave through staging rows of their warp (warp_rows.cuh): 16 rows per warp, one
// pass of 128 bf16 columns (256 bytes) each.
inline constexpr uint32_t kStagingRowBytes = 256;
inline constexpr uint32_t kWarpStagingBytes = 16 * kStagingRowBytes;

// Stages of the cooperative engine's ring. A 4th stage for bf16 outputs (it fits beside the 32 KB
// staging tile) measured no faster, and slower on the qwen3-30b forward GEMMs (perf-notes/gemm.md)
// and on the EP 1 gate/up dgrad; wgrad's tiles, 4 k-blocks each at EP 1, take it: with 3 they wait
// on their loads and run slower (perf-notes/backward.md).
__host__ __device__ constexpr int cooperative_stages(GemmKind kind, EpilogueKind epilogue) {
  return kind == GemmKind::kWgrad || !uses_staged_store(epilogue) ? 4 : 3;
}

// wgrad on the cooperative engine runs on clusters of two CTAs: the pair computes the tiles of
// M blocks 2p and 2p + 1 at one N block, and each CTA loads half of their common B tile by TMA
// multicast into both. At EP 1 an expert's K is its ~256 rows, so a (128, 256) tile moves 384
// bytes of operands per 256 FLOP; sharing B cuts the L2 reads by a third. Measured on H200
// (perf-notes/backward.md): wgrad down a little faster, gate/up level; what limits these short
// tiles is the ring's depth against the loads' latency, not the L2's bandwidth.
inline constexpr int kWgradClusterSize = 2;

// Dynamic shared memory: the stage ring (1024-byte aligned for the 128-byte swizzle), the output
// staging tile, then the barriers. The same struct sizes the launch on the host and finds the
// buffers on the device. kTailBarriers: wgrad's tail blocks have a tail barrier per stage (the
// producer loads the next tail block into another stage while the last one is still being
// published, tile_loader.cuh; in a cluster, a peer may too); other kinds have one, unused.
template <EpilogueKind kEpilogue, int kStages = cooperative_stages(GemmKind::kForward, kEpilogue),
          int kCluster = 1, int kTailBarriers = 1>
struct SharedLayout {
  using Config = TileConfig;
  static constexpr bool kStagedStore = uses_staged_store(kEpilogue);
  static constexpr int kNumStages = kStages;
  static constexpr int kClusterSize = kCluster;
  static constexpr int kNumTailBarriers = kTailBarriers;
  static constexpr uint32_t kAlignment = 1024;
  static constexpr uint32_t kAOffset = 0;  // (kNumStages, BLOCK_M, BLOCK_K)
  static constexpr uint32_t kBOffset = kNumStages * TileConfig::kABytes;
  static constexpr uint32_t kStagingOffset = kBOffset + kNumStages * TileConfig::kBBytes;
  // bf16 outputs: 16 staging rows per consumer warp (warp_rows.cuh), 256 bytes each.
  static constexpr uint32_t kStagingBytes =
      kStagedStore ? TileConfig::kNumConsumerWarpgroups * 4 * kWarpStagingBytes : 0;
  static constexpr uint32_t kBarrierOffset = kStagingOffset + kStagingBytes;
  // full[kNumStages], empty[kNumStages], tail[kNumTailBarriers] (the wgrad row tails' staging)
  static constexpr uint32_t kNumBarriers = 2 * kNumStages + kNumTailBarriers;
  static constexpr uint32_t kBytes = kBarrierOffset + kNumBarriers * 8;
  static constexpr uint32_t kLaunchBytes = kBytes + kAlignment;  // slack to align the base
  static_assert(kLaunchBytes <= 227 * 1024, "shared memory layout exceeds the 227 KiB limit");
};

// The cooperative kernel's layout for a GEMM kind: what the kernel carves and its launch sizes.
template <GemmKind kKind, EpilogueKind kEpilogue, int kClusterSize = 1>
using CooperativeLayout =
    SharedLayout<kEpilogue, cooperative_stages(kKind, kEpilogue), kClusterSize,
                 kKind == GemmKind::kWgrad ? cooperative_stages(kKind, kEpilogue) : 1>;

struct GroupedGemmParams {
  const int* group_offsets;  // [num_groups + 1], device memory
  int num_groups;
  int m;         // wgrad: rows of each group's C; unused otherwise (the group's row count)
  int n;         // columns of C (before the SwiGLU halving)
  int k;         // reduction length for forward/dgrad; unused for wgrad (the group's row count)
  void* output;  // forward/dgrad: [rows, N] (SwiGLU: [rows, N / 2]); wgrad: [groups, M, N]
  // [num_groups] device, or null: group g's rows are group_offsets[g] .. + group_counts[g] (the
  // rest up to group_offsets[g + 1] is padding no tile reads); null: up to group_offsets[g + 1].
  const int* group_counts = nullptr;
  // kSwiGluFp8: h's fp32 scales, (rows, N / 256), one per row and 128 columns of h.
  float* output_scales = nullptr;
  // forward/dgrad, staged bf16 outputs: row r of the call's rows goes to output row
  // output_rows[r] (device, [rows]); null: row r.
  const int32_t* output_rows = nullptr;
  // [2] device, or null: the call's groups are group_range[0] .. group_range[1] - 1 (the others
  // take no tile); null: 0 .. num_groups - 1.
  const int* group_range = nullptr;
};

__host__ __device__ constexpr int ceil_div(int a, int b) { return (a + b - 1) / b; }

}  // namespace mok::gemm
