// The FP8 blockwise-scaled grouped GEMM (DeepSeek-V3 recipe): what it computes, its tile and its
// shared-memory layout; one set of definitions for the host launcher and the device code.
//
// Forward only: C[m, n] = sum over k-blocks kb of (sa[m, kb] · sb[n / 128, kb]) · P[m, n, kb],
//   P[m, n, kb] = sum_{k in kb} a[m, k] · b[n, k]  (E4M3 values, one 128-wide block of K)
// with A (rows, K) E4M3 scaled per 1 x 128 along K (fp32 sa, (rows, K / 128)) and B (E, N, K)
// E4M3 scaled per 128 x 128 block (fp32 sb, (E, ceil(N / 128), K / 128)): the layouts of
// mok::quantize's kFp8 rowwise and 128 x 128 quantizers. Each P is summed by wgmma in a fresh
// register set and promoted into the fp32 accumulators, accum = fma(P, fp32(sa · sb), accum), in
// k-block order: one order per output element, whatever the grid.
#pragma once

#include <cstdint>

#include "kernels/gemm/gemm_types.cuh"

namespace mok::gemm {

// A (128, 256) output tile, k-blocks of 128 (one scale block, one 128-byte swizzle row of E4M3),
// a producer warpgroup and two consumer warpgroups of 64 rows each. A consumer sums a k-block in
// two pieces of 128 columns (one B scale each), so that its fp32 accumulators (128 registers) and
// one piece's partial sums (64) fit its register budget, while the CTA still reads each A k-block
// once per 256 columns.
struct Fp8TileConfig {
  static constexpr int BLOCK_M = static_cast<int>(kRowBlock);
  static constexpr int BLOCK_N = 256;
  static constexpr int BLOCK_K = 128;      // E4M3 elements = bytes
  static constexpr int kScaleBlock = 128;  // K (and weight N) length of one scale
  static constexpr int kPiece = 128;       // columns a consumer sums into one partial set
  static constexpr int kNumPieces = BLOCK_N / kPiece;
  static constexpr int kNumConsumerWarpgroups = 2;
  static constexpr int kNumThreads = 128 * (1 + kNumConsumerWarpgroups);
  static constexpr uint32_t kABytes = BLOCK_M * BLOCK_K;     // (BLOCK_M, BLOCK_K) E4M3
  static constexpr uint32_t kBBytes = BLOCK_N * BLOCK_K;     // (BLOCK_N, BLOCK_K) E4M3
  static constexpr uint32_t kPieceBytes = kPiece * BLOCK_K;  // (kPiece, BLOCK_K) of B
  static constexpr uint32_t kStageBytes = kABytes + kBBytes;
  static_assert(BLOCK_M == 128 && BLOCK_K == kScaleBlock && kPiece == kScaleBlock &&
                    BLOCK_N % kPiece == 0,
                "one A scale per tile row and one B scale per piece and k-block");
};

// Dynamic shared memory: the stage ring (1024-byte aligned for the 128-byte swizzle), the bf16
// output staging rows, each stage's scales, then the barriers.
template <EpilogueKind kEpilogue>
struct Fp8SharedLayout {
  using Config = Fp8TileConfig;
  static constexpr bool kStagedStore = uses_staged_store(kEpilogue);
  // As many stages as fit beside the staging rows (a 4th does not, by 128 bytes).
  static constexpr int kNumStages = kStagedStore ? 3 : 4;
  static constexpr uint32_t kAlignment = 1024;
  static constexpr uint32_t kAOffset = 0;  // (kNumStages, BLOCK_M, BLOCK_K)
  static constexpr uint32_t kBOffset = kNumStages * Config::kABytes;
  static constexpr uint32_t kStagingOffset = kBOffset + kNumStages * Config::kBBytes;
  static constexpr uint32_t kStagingBytes =
      kStagedStore ? Config::kNumConsumerWarpgroups * 4 * kWarpStagingBytes : 0;
  // (kNumStages, BLOCK_M) fp32: the A scales of the tile's rows for the stage's k-block.
  static constexpr uint32_t kScaleAOffset = kStagingOffset + kStagingBytes;
  // (kNumStages, 4) fp32: the stage's B scales (one per piece), 16 bytes apart.
  static constexpr uint32_t kScaleBOffset = kScaleAOffset + kNumStages * Config::BLOCK_M * 4;
  static constexpr uint32_t kScaleBStride = 16;
  static_assert(Config::kNumPieces * 4 <= kScaleBStride, "a stage's B scales fit their slot");
  static constexpr uint32_t kBarrierOffset = kScaleBOffset + kNumStages * kScaleBStride;
  static constexpr int kNumBarriers = 2 * kNumStages;  // full[kNumStages], empty[kNumStages]
  static constexpr uint32_t kBytes = kBarrierOffset + kNumBarriers * 8;
  static constexpr uint32_t kLaunchBytes = kBytes + kAlignment;  // slack to align the base
  static_assert(kLaunchBytes <= 227 * 1024, "shared memory layout exceeds the 227 KiB limit");
};

struct Fp8GemmParams {
  GroupedGemmParams grouped;  // offsets, counts, n, k (a multiple of 128), output
  const float* a_scales;      // (capacity_rows, k / 128)
  const float* b_scales;      // (num_groups, ceil(n / 128), k / 128)
};

}  // namespace mok::gemm
