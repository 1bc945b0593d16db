// The FP8 blockwise-scaled grouped GEMM (DeepSeek-V3 recipe): what it computes, its tile and its
// shared-memory layout; one set of definitions for the host launcher and the device code.
//
// Both operands are E4M3 and K-major (the only layout FP8 wgmma takes), K in blocks of 128:
//   C[m, n] = sum over k-blocks kb of (sa · sb) · P[m, n, kb],
//   P[m, n, kb] = sum_{k in kb} a[m, k] · b[n, k]  (E4M3 values, one 128-wide block of K)
// GemmKind::kForward (the forward, and the dgrad on the transposed weight): A (rows, K) scaled
//   per 1 x 128 along K (sa (rows, K / 128)), B (E, N, K) per 128 x 128 block (sb (E, ceil(N /
//   128), K / 128)), the scale sa[m, kb] · sb[n / 128, kb]; K the same for every group.
// GemmKind::kWgrad: K is the group's rows. A (M, capacity_rows) and B (N, capacity_rows) are the
//   transposed copies of dY and X, scaled per 1 x 128 along the rows (sa (M, capacity_rows / 128),
//   sb (N, capacity_rows / 128)), the scale sa[m, kb] · sb[n, kb] per element; a group's rows
//   start on a 128-row boundary, and rows of its last block past its count are zeroed in shared
//   memory before the MMAs (they may be padding or another group's); that block's wgmma steps
//   (32 rows each) past the count are skipped.
// The layouts are those of mok::quantize's kFp8 quantizers. Each P is summed by wgmma in a fresh
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

// Stages of the ring: as many as fit, 4 (beside the forward's 32 KB bf16 staging rows too, with a
// reduced alignment slack: Fp8SharedLayout::kAlignmentSlack); the wgrad's bf16 output, whose
// stages carry 1 KB of column scales each beside a whole tile's staging (64 KB), 3.
__host__ __device__ constexpr int fp8_stages(GemmKind kind, EpilogueKind epilogue) {
  return kind == GemmKind::kWgrad && uses_staged_store(epilogue) ? 3 : 4;
}

// The forward (and dgrad) on clusters of two CTAs: the pair computes M blocks 2p and 2p + 1 of one
// group at one N block, and each CTA loads one 128-column piece of their common weight tile by TMA
// multicast into both (Fp8Scheduler).
inline constexpr int kFp8ClusterSize = 2;

// Dynamic shared memory: the stage ring (1024-byte aligned for the 128-byte swizzle), the bf16
// output staging (rows of each warp; the wgrad's bf16 gradients: the whole tile, TileBoxes), each
// stage's scales, then the barriers. kClusterSize > 1: B's pieces also come from the peers'
// multicasts, at the same offsets.
template <EpilogueKind kEpilogueKind, GemmKind kGemmKind = GemmKind::kForward,
          int kStages = fp8_stages(kGemmKind, kEpilogueKind), int kCluster = 1>
struct Fp8SharedLayout {
  using Config = Fp8TileConfig;
  static constexpr EpilogueKind kEpilogue = kEpilogueKind;
  static constexpr GemmKind kKind = kGemmKind;
  static constexpr int kClusterSize = kCluster;
  static_assert(kCluster == 1 || (kKind == GemmKind::kForward && kCluster == Config::kNumPieces),
                "clusters: the forward's weight tile, one 128-column piece per CTA");
  // (kSwiGluFp8 stages its E4M3 rows in the same warp rows)
  static constexpr bool kStagedStore =
      uses_staged_store(kEpilogue) || kEpilogue == EpilogueKind::kSwiGluFp8;
  // The wgrad's bf16 gradients leave a whole staged tile at a time, by a store warp (TileBoxes).
  static constexpr bool kTileStaging =
      kKind == GemmKind::kWgrad && kEpilogue == EpilogueKind::kStoreBf16;
  static constexpr int kNumStages = kStages;
  static constexpr uint32_t kAlignment = 1024;
  static constexpr uint32_t kAOffset = 0;  // (kNumStages, BLOCK_M, BLOCK_K)
  static constexpr uint32_t kBOffset = kNumStages * Config::kABytes;
  static constexpr uint32_t kStagingOffset = kBOffset + kNumStages * Config::kBBytes;
  static constexpr uint32_t kStagingBytes =
      kTileStaging   ? Config::BLOCK_M * Config::BLOCK_N * 2
      : kStagedStore ? Config::kNumConsumerWarpgroups * 4 * kWarpStagingBytes
                     : 0;
  // (kNumStages, BLOCK_M) fp32: the A scales of the tile's rows for the stage's k-block.
  static constexpr uint32_t kScaleAOffset = kStagingOffset + kStagingBytes;
  // The stage's B scales: forward (kNumStages, 4) fp32, one per piece, 16 bytes apart; wgrad
  // (kNumStages, BLOCK_N) fp32, one per column of the tile.
  static constexpr uint32_t kScaleBOffset = kScaleAOffset + kNumStages * Config::BLOCK_M * 4;
  static constexpr uint32_t kScaleBStride = kKind == GemmKind::kWgrad ? Config::BLOCK_N * 4 : 16;
  static_assert(Config::kNumPieces * 4 <= kScaleBStride &&
                    (kKind != GemmKind::kWgrad || Config::BLOCK_N * 4 <= kScaleBStride),
                "a stage's B scales fit their slot");
  static constexpr uint32_t kBarrierOffset = kScaleBOffset + kNumStages * kScaleBStride;
  // full[kNumStages], empty[kNumStages]; with kTileStaging, TileBoxes' staged and free.
  static constexpr int kNumBarriers = 2 * kNumStages + (kTileStaging ? 2 : 0);
  static constexpr uint32_t kBytes = kBarrierOffset + kNumBarriers * 8;
  static constexpr uint32_t kSmemLimit = 227 * 1024;
  static_assert(kBytes <= kSmemLimit, "shared memory layout exceeds the 227 KiB limit");
  // Slack to align the base: a whole kAlignment where it fits, else what is left (4 stages beside
  // the bf16 staging rows leave 896 bytes). NOTE: without static shared memory the dynamic base
  // is 1024-aligned and takes none; the kernel traps if it ever needs more than the slack.
  static constexpr uint32_t kAlignmentSlack =
      kBytes + kAlignment <= kSmemLimit ? kAlignment : (kSmemLimit - kBytes) / 16 * 16;
  static constexpr uint32_t kLaunchBytes = kBytes + kAlignmentSlack;
};

struct Fp8GemmParams {
  GroupedGemmParams
      grouped;            // offsets, counts, m (wgrad), n, k (forward: a multiple of 128), output
  const float* a_scales;  // forward (capacity_rows, k / 128); wgrad (m, capacity_rows / 128)
  const float*
      b_scales;  // forward (num_groups, ceil(n / 128), k / 128); wgrad (n, capacity_rows / 128)
  int num_row_blocks = 0;  // wgrad: capacity_rows / 128, the scales' row stride
  // kSwiGluFp8 in the kernel's kGateUp instance: the gate/up sums rounded to bf16 as well, N
  // columns in W's row order (kStoreBf16's bytes; a training forward's context for the backward),
  // row r of the GEMM at gate_up row gate_up_rows[r] (< 0: not stored), or at row r when null.
  void* gate_up = nullptr;
  const int32_t* gate_up_rows = nullptr;
};

// K-blocks of a tile: all of K (forward), or the group's rows in blocks of 128 (wgrad).
template <GemmKind kKind>
__host__ __device__ inline int fp8_num_k_blocks(const Fp8GemmParams& params, int group_rows) {
  if constexpr (kKind == GemmKind::kWgrad) {
    return ceil_div(group_rows, Fp8TileConfig::BLOCK_K);
  } else {
    return params.grouped.k / Fp8TileConfig::BLOCK_K;
  }
}

}  // namespace mok::gemm
