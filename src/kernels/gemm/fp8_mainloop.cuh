// The FP8 mainloop: a producer warp streams each tile's (A, B) k-blocks into the stage ring with
// TMA and the k-block's scales beside them with cp.async (the A scales of the tile's 128 rows; a B
// scale per 128 columns in the forward, per column in the wgrad); each consumer warpgroup sums
// one k-block's E4M3 products, 128 columns at a time, with wgmma into a fresh register set and
// promotes it into its fp32 accumulators with the two scales.
//
// full[s] completes when the stage's tiles (TMA bytes) and scales (one cp.async arrival per
// producer lane) have landed; empty[s] when all consumer warps have read the stage — on a cluster
// (the forward, kFp8ClusterSize), those of every CTA whose multicast writes B's pieces into it.
// K-blocks run in natural order and each is promoted once, so each output's sum has one fixed
// order.
#pragma once

#include <cuda.h>

#include "kernels/gemm/fp8_gemm_types.cuh"
#include "kernels/gemm/fp8_tile_scheduler.cuh"
#include "kernels/gemm/kernel_roles.cuh"
#include "kernels/gemm/mainloop.cuh"
#include "kernels/gemm/tile_scheduler.cuh"
#include "kernels/ptx/barrier.cuh"
#include "kernels/ptx/cp_async.cuh"
#include "kernels/ptx/named_barrier.cuh"
#include "kernels/ptx/tma.cuh"
#include "kernels/ptx/wgmma.cuh"
#include "kernels/ptx/wgmma_fp8.cuh"

namespace mok::gemm {

// A wgrad group whose rows do not start on a 128-row boundary: its k-blocks would straddle the
// scale blocks of the transposed operands (the host never reads the offsets to check this).
inline __device__ __noinline__ void fp8_wgrad_group_misaligned() { __trap(); }

// Layout: an Fp8SharedLayout (epilogue, kind, stages, cluster size).
template <class Layout>
struct Fp8Mainloop {
  static constexpr GemmKind kKind = Layout::kKind;
  static_assert(kKind == GemmKind::kForward || kKind == GemmKind::kWgrad,
                "the dgrad is the forward on the transposed weight (both operands K-major)");
  static constexpr bool kWgrad = kKind == GemmKind::kWgrad;
  static constexpr int kClusterSize = Layout::kClusterSize;
  using Config = Fp8TileConfig;
  using State = PipelineState<Layout::kNumStages>;
  static constexpr int kNumAccumulators = Config::BLOCK_N / 2;  // (64, BLOCK_N) per consumer
  // Arrivals on full[s]: the TMA issuer's expect_tx, and every producer lane's cp.async arrival.
  static constexpr uint32_t kFullArrivals = 1 + 32;
  // Arrivals on empty[s]: every consumer warp of every CTA whose multicast writes into the stage.
  static constexpr uint32_t kEmptyArrivals = Config::kNumConsumerWarpgroups * 4 * kClusterSize;

  struct Storage {
    uint8_t* a;        // (kNumStages, BLOCK_M, BLOCK_K) E4M3, swizzled
    uint8_t* b;        // (kNumStages, BLOCK_N, BLOCK_K) E4M3, swizzled
    uint8_t* staging;  // the bf16 output rows on their way out
    float* scale_a;    // (kNumStages, BLOCK_M)
    float* scale_b;    // forward (kNumStages, 4), elements [0, kNumPieces) used; wgrad
                       // (kNumStages, BLOCK_N)
    uint64_t* full;    // (kNumStages)
    uint64_t* empty;   // (kNumStages)
    uint64_t* staged;  // Layout::kTileStaging: TileBoxes' barriers (else null)
    uint64_t* staging_free;

    __device__ static Storage carve(uint8_t* aligned_base) {
      auto* barriers = reinterpret_cast<uint64_t*>(aligned_base + Layout::kBarrierOffset);
      uint64_t* tile_barriers = Layout::kTileStaging ? barriers + 2 * Layout::kNumStages : nullptr;
      return {aligned_base + Layout::kAOffset,
              aligned_base + Layout::kBOffset,
              aligned_base + Layout::kStagingOffset,
              reinterpret_cast<float*>(aligned_base + Layout::kScaleAOffset),
              reinterpret_cast<float*>(aligned_base + Layout::kScaleBOffset),
              barriers,
              barriers + Layout::kNumStages,
              tile_barriers,
              Layout::kTileStaging ? tile_barriers + 1 : nullptr};
    }
    __device__ uint8_t* a_stage(int stage) const { return a + stage * Config::kABytes; }
    __device__ uint8_t* b_stage(int stage) const { return b + stage * Config::kBBytes; }
    __device__ float* scale_a_stage(int stage) const { return scale_a + stage * Config::BLOCK_M; }
    __device__ float* scale_b_stage(int stage) const {
      return scale_b + stage * (Layout::kScaleBStride / 4);
    }
  };

  __device__ static void init_barriers(const Storage& smem) {
    for (int stage = 0; stage < Layout::kNumStages; ++stage) {
      ptx::mbarrier_init(&smem.full[stage], kFullArrivals);
      ptx::mbarrier_init(&smem.empty[stage], kEmptyArrivals);
    }
    ptx::fence_barrier_init();
  }

  // Producer side, all 32 lanes of one warp (lane 0 issues the TMA copies). The maps read the
  // E4M3 bytes as bf16 pairs (runtime/gemm_fp8.cu), so element coordinates along K are bytes / 2.
  __device__ static void load(const CUtensorMap* map_a, const CUtensorMap* map_b,
                              const Storage& smem, const Fp8GemmParams& params,
                              const GroupedTile& tile, State& state) {
    const int num_k_blocks = fp8_num_k_blocks<kKind>(params, tile.row_count);
    if constexpr (kWgrad) {
      if (num_k_blocks > 0 && tile.row_begin % Config::BLOCK_K != 0) fp8_wgrad_group_misaligned();
    }
    for (int k_block = 0; k_block < num_k_blocks; ++k_block) {
      ptx::mbarrier_wait_trap_out_of_line(&smem.empty[state.index], state.phase ^ 1u);
      uint64_t* full = &smem.full[state.index];
      if constexpr (kWgrad) {
        load_wgrad_stage(map_a, map_b, smem, params, tile, k_block, full, state.index);
      } else {
        load_forward_stage(map_a, map_b, smem, params, tile, k_block, num_k_blocks, full,
                           state.index);
      }
      ptx::cp_async_mbarrier_arrive(full);
      state.advance();
    }
  }

  // The producer lanes' last copies have landed (before the warp exits). On a cluster, also every
  // consumer warp of every CTA has handed back the last stages: no peer arrives on this CTA's
  // barriers after it exits (the peers' multicasts into it have landed before its own consumers'
  // last waits). NOTE: a cluster_sync at the kernel's end instead made ptxas spill the producer.
  __device__ static void drain_loads(const Storage& smem, State state) {
    ptx::cp_async_wait_all();
    if constexpr (kClusterSize > 1) {
      for (int stage = 0; stage < Layout::kNumStages; ++stage) {
        ptx::mbarrier_wait_trap_out_of_line(&smem.empty[state.index], state.phase ^ 1u);
        state.advance();
      }
    }
  }

  using Mma = ptx::WgmmaFp8<Config::kPiece>;
  static constexpr int kPieceAccumulators = Mma::kNumAccumulators;  // (64, kPiece) fragment

  // The wgrad with bf16 gradients (tile stores, no branch) issues a tile's first wgmma group
  // (k-block 0, piece 0) before the previous tile's epilogue (issue_first), so that the tensor
  // cores work while the consumers store: its tiles are a few k-blocks long, and the epilogue is
  // a large share of each. The partial sums then live across the epilogue, in the caller's
  // registers. (The fp32 epilogues branch per element: ptxas would wait for the group there.)
  static constexpr bool kLookahead = kWgrad && Layout::kEpilogue == EpilogueKind::kStoreBf16;

  // Consumer side: adds this warpgroup's (64, BLOCK_N) slice of the tile to `accum`; in a half
  // tile (fp8_is_half_tile), rows 0-63 of column piece consumer_idx into accum[0, 64).
  // first_issued: issue_first has issued the tile's first group into `partial`, and the caller
  // has waited for it (wgmma_wait_group) after its own work.
  __device__ static void mma(const Storage& smem, const Fp8GemmParams& params,
                             const GroupedTile& tile, int consumer_idx, State& state,
                             float (&accum)[kNumAccumulators], float (&partial)[kPieceAccumulators],
                             bool first_issued) {
    if (fp8_is_half_tile<kKind, Layout::kEpilogue>(tile)) {
      // NOTE: the first piece's fragment is the first 64 accumulators of the whole slice's
      // (fragment.cuh), whichever piece of B it multiplies.
      mma_k_blocks<1>(smem, params, tile, 0, consumer_idx, 0, state,
                      reinterpret_cast<float(&)[kPieceAccumulators]>(accum), partial, false);
    } else {
      mma_k_blocks<Config::kNumPieces>(smem, params, tile, consumer_idx * (Config::kABytes / 2), 0,
                                       consumer_idx * 64, state, accum, partial, first_issued);
    }
  }

  // kLookahead: waits for the tile's first stage and issues its first wgmma group (piece 0 of
  // k-block 0, masked as mma would) into `partial`, without waiting for it; the caller waits,
  // then mma goes on from there. The stage stays at `state` (mma advances it). False when there is
  // nothing to issue.
  __device__ static bool issue_first(const Storage& smem, const Fp8GemmParams& params,
                                     const GroupedTile& tile, int consumer_idx, const State& state,
                                     float (&partial)[kPieceAccumulators]) {
    if constexpr (!kLookahead) {
      return false;
    } else {
      if (fp8_num_k_blocks<kKind>(params, tile.row_count) == 0) return false;
      ptx::mbarrier_wait_trap_out_of_line(&smem.full[state.index], state.phase);
      const int k_steps = prepare_k_block(smem, tile, 0, state.index);
      const uint32_t a_base =
          ptx::smem_address(smem.a_stage(state.index)) + consumer_idx * (Config::kABytes / 2);
      const uint32_t b_base = ptx::smem_address(smem.b_stage(state.index));
#pragma unroll
      for (int i = 0; i < kPieceAccumulators; ++i) ptx::fence_operand(partial[i]);
      issue_wgrad_steps(k_steps, a_base, b_base, partial);
      return true;
    }
  }

  // Consumer side of an empty tile (fp8_is_empty_tile, on a cluster): its stages hold the peers'
  // shares of B and no A; each is handed back unread.
  __device__ static void skip(const Storage& smem, const Fp8GemmParams& params,
                              const GroupedTile& tile, State& state) {
    const int lane_idx = static_cast<int>(threadIdx.x % 32);
    const int num_k_blocks = fp8_num_k_blocks<kKind>(params, tile.row_count);
    for (int k_block = 0; k_block < num_k_blocks; ++k_block) {
      ptx::mbarrier_wait_trap_out_of_line(&smem.full[state.index], state.phase);
      release_stage(smem, state.index, lane_idx);
      state.advance();
    }
  }

 private:
  static constexpr int kNumConsumerThreads = Config::kNumConsumerWarpgroups * kWarpgroupThreads;

  // One forward stage: A rows of the tile (k-block along the in features), B rows of the group's
  // weight, A's row scales and one B scale per 128-column piece.
  __device__ static void load_forward_stage(const CUtensorMap* map_a, const CUtensorMap* map_b,
                                            const Storage& smem, const Fp8GemmParams& params,
                                            const GroupedTile& tile, int k_block, int num_k_blocks,
                                            uint64_t* full, int stage) {
    const int lane_idx = static_cast<int>(threadIdx.x % 32);
    const int tile_first_row = tile.mblock * Config::BLOCK_M;  // in the group
    const int rows_valid = tile.row_count - tile_first_row;
    const int64_t first_row = static_cast<int64_t>(tile.row_begin) + tile_first_row;
    const int num_n_scales = ceil_div(params.grouped.n, Config::kScaleBlock);
    const float* b_scales = params.b_scales + (static_cast<int64_t>(tile.group) * num_n_scales +
                                               tile.n_block * Config::kNumPieces) *
                                                  num_k_blocks;
    if (lane_idx == 0) {
      // An empty tile (past the group's rows, on a cluster) loads only its share of B.
      const bool has_rows = rows_valid > 0;
      ptx::mbarrier_arrive_expect_tx(full, has_rows ? Config::kStageBytes : Config::kBBytes);
      const int k_pairs = k_block * Config::BLOCK_K / 2;
      if (has_rows) {
        ptx::tma_load_2d(smem.a_stage(stage), map_a, full, k_pairs,
                         static_cast<int32_t>(first_row));
      }
      if constexpr (kClusterSize > 1) {
        // CTA r loads piece r of the weight tile (map_b's box: one piece) into every CTA.
        constexpr uint16_t kAllCtas = (1u << kClusterSize) - 1;
        const int piece = static_cast<int>(ptx::cluster_cta_rank());
        ptx::tma_load_3d_multicast(smem.b_stage(stage) + piece * Config::kPieceBytes, map_b, full,
                                   k_pairs, tile.n_block * Config::BLOCK_N + piece * Config::kPiece,
                                   tile.group, kAllCtas);
      } else {
        ptx::tma_load_3d(smem.b_stage(stage), map_b, full, k_pairs, tile.n_block * Config::BLOCK_N,
                         tile.group);
      }
    }
    // Rows past the group's end get scale 0 (never read: their outputs are not stored, and
    // rows past the tensor would be out of bounds).
    float* scale_a = smem.scale_a_stage(stage);
#pragma unroll
    for (int i = 0; i < Config::BLOCK_M / 32; ++i) {
      const int row = lane_idx + 32 * i;
      const bool valid = row < rows_valid;
      const float* source =
          valid ? params.a_scales + (first_row + row) * num_k_blocks + k_block : params.a_scales;
      ptx::cp_async_4(scale_a + row, source, valid);
    }
    if (lane_idx < Config::kNumPieces) {
      // A piece past N (the last tile of an N not a multiple of 256) gets scale 0.
      const bool valid = tile.n_block * Config::kNumPieces + lane_idx < num_n_scales;
      ptx::cp_async_4(smem.scale_b_stage(stage) + lane_idx,
                      valid ? b_scales + lane_idx * num_k_blocks + k_block : b_scales, valid);
    }
  }

  // kCount scales of one 128-row block, of features first .. first + kCount - 1 (0 from `limit`
  // on); scales (features, num_row_blocks). NOTE: the loop stays rolled: unrolled, its addresses
  // (12 for both operands) spilled the producer's 40 registers.
  template <int kCount>
  __device__ static void load_wgrad_scales(float* destination, const float* scales, int first,
                                           int limit, int num_row_blocks, int row_block,
                                           int lane_idx) {
#pragma unroll 1
    for (int i = 0; i < kCount / 32; ++i) {
      const int feature = first + lane_idx + 32 * i;
      const bool valid = feature < limit;
      const float* source =
          valid ? scales + static_cast<int64_t>(feature) * num_row_blocks + row_block : scales;
      ptx::cp_async_4(destination + lane_idx + 32 * i, source, valid);
    }
  }

  // One wgrad stage: 128 of the group's rows (the K of this GEMM) of the tile's A rows (out
  // features, the transposed dY) and B rows (in features, the transposed X), and their scales,
  // one per tile row and per tile column. Rows past the tensor are zero-filled by TMA; rows past
  // the group's count inside the tensor are zeroed by the consumers (mask_group_tail).
  __device__ static void load_wgrad_stage(const CUtensorMap* map_a, const CUtensorMap* map_b,
                                          const Storage& smem, const Fp8GemmParams& params,
                                          const GroupedTile& tile, int k_block, uint64_t* full,
                                          int stage) {
    const int lane_idx = static_cast<int>(threadIdx.x % 32);
    const int first_m = tile.mblock * Config::BLOCK_M;
    const int first_n = tile.n_block * Config::BLOCK_N;
    const int row_block = tile.row_begin / Config::BLOCK_K + k_block;  // of the tensor
    if (lane_idx == 0) {
      ptx::mbarrier_arrive_expect_tx(full, Config::kStageBytes);
      const int k_pairs = (tile.row_begin + k_block * Config::BLOCK_K) / 2;
      ptx::tma_load_2d(smem.a_stage(stage), map_a, full, k_pairs, first_m);
      ptx::tma_load_2d(smem.b_stage(stage), map_b, full, k_pairs, first_n);
    }
    // Rows of A past M and columns past N get scale 0 (their outputs are not stored).
    load_wgrad_scales<Config::BLOCK_M>(smem.scale_a_stage(stage), params.a_scales, first_m,
                                       params.grouped.m, params.num_row_blocks, row_block,
                                       lane_idx);
    load_wgrad_scales<Config::BLOCK_N>(smem.scale_b_stage(stage), params.b_scales, first_n,
                                       params.grouped.n, params.num_row_blocks, row_block,
                                       lane_idx);
  }

  // Wgrad: zeroes the K positions (group rows) >= rows_valid of the stage's A (BLOCK_M) and B
  // (BLOCK_N) rows, so that the group's last, partial block sums its own rows only (the rest of
  // the block may be padding or the next group's rows, even E4M3 NaNs). All consumer threads take
  // part; the stage is swizzled by 128 bytes (16-byte unit u of row r at u ^ (r % 8)).
  // Only the units before end_unit (those the k-block's wgmma steps read) are touched.
  __device__ static void mask_group_tail(const Storage& smem, int stage, int rows_valid,
                                         int end_unit) {
    constexpr int kRows = Config::BLOCK_M + Config::BLOCK_N;
    const int first_unit = rows_valid / 16;  // units before it are wholly valid
    const int units_to_mask = end_unit - first_unit;
    const int consumer_thread = static_cast<int>(threadIdx.x) - kWarpgroupThreads;
    for (int item = consumer_thread; item < kRows * units_to_mask; item += kNumConsumerThreads) {
      const int row = item / units_to_mask;
      const int unit = first_unit + item % units_to_mask;
      uint8_t* row_base = row < Config::BLOCK_M
                              ? smem.a_stage(stage) + row * Config::BLOCK_K
                              : smem.b_stage(stage) + (row - Config::BLOCK_M) * Config::BLOCK_K;
      auto* chunk = reinterpret_cast<uint4*>(row_base + ((unit ^ (row % 8)) * 16));
      uint4 bytes = *chunk;
      uint32_t* words = reinterpret_cast<uint32_t*>(&bytes);
#pragma unroll
      for (int w = 0; w < 4; ++w) {
        const int first_k = unit * 16 + 4 * w;  // K position of the word's first byte
        const int keep = min(max(rows_valid - first_k, 0), 4);
        words[w] = keep == 4 ? words[w] : (words[w] & ((1u << (8 * keep)) - 1u));
      }
      *chunk = bytes;
    }
    // NOTE: the zeros are generic-proxy stores that wgmma (async proxy) reads next.
    ptx::fence_proxy_async_shared();
    ptx::named_barrier_sync<static_cast<uint32_t>(NamedBarrier::kConsumers), kNumConsumerThreads>();
  }

  // The wgmma steps (32 along K) of a k-block: all of them, or in the wgrad's group's last,
  // partial block only those over its rows (the steps past them would multiply zeros), with
  // that block's tail masked first when `mask`.
  __device__ static int prepare_k_block(const Storage& smem, const GroupedTile& tile, int k_block,
                                        int stage, bool mask = true) {
    if constexpr (kWgrad) {
      const int rows_valid = tile.row_count - k_block * Config::BLOCK_K;
      if (rows_valid < Config::BLOCK_K) {
        const int k_steps = ceil_div(rows_valid, 32);
        if (mask) mask_group_tail(smem, stage, rows_valid, 2 * k_steps);
        return k_steps;
      }
    }
    return kKSteps;
  }

  // One piece's wgmma group of k_steps steps into a fresh `partial`.
  // NOTE: one whole unrolled sequence per step count, chosen before the first wgmma: a condition
  // on each wgmma made ptxas serialize them (perf-notes/backward.md).
  __device__ static void issue_wgrad_steps(int k_steps, uint32_t a_base, uint32_t b_base,
                                           float (&partial)[kPieceAccumulators]) {
    switch (k_steps) {
      case 1:
        issue_k_steps<1>(a_base, b_base, partial);
        break;
      case 2:
        issue_k_steps<2>(a_base, b_base, partial);
        break;
      case 3:
        issue_k_steps<3>(a_base, b_base, partial);
        break;
      default:
        issue_k_steps<kKSteps>(a_base, b_base, partial);
        break;
    }
  }

  // The k-loop of one tile over kPieces pieces of 128 columns, from piece first_piece of B on: A
  // read from a_offset into each stage, this warpgroup's rows starting at tile row first_row.
  // partial: one piece's k-block sums, (64, kPiece) fragment; first_issued: piece 0 of k-block 0
  // was issued into it (issue_first) and has completed (wgmma_wait_group).
  template <int kPieces>
  __device__ static void mma_k_blocks(const Storage& smem, const Fp8GemmParams& params,
                                      const GroupedTile& tile, uint32_t a_offset, int first_piece,
                                      int first_row, State& state,
                                      float (&accum)[kPieces * kPieceAccumulators],
                                      float (&partial)[kPieceAccumulators], bool first_issued) {
    const int num_k_blocks = fp8_num_k_blocks<kKind>(params, tile.row_count);
    int k_block = 0;
    if constexpr (kLookahead) {
      if (first_issued) {
        k_block_pieces<kPieces, true>(smem, tile, k_block, a_offset, first_piece, first_row, state,
                                      accum, partial);
        k_block = 1;
      }
    }
    for (; k_block < num_k_blocks; ++k_block) {
      ptx::mbarrier_wait_trap_out_of_line(&smem.full[state.index], state.phase);
      k_block_pieces<kPieces, false>(smem, tile, k_block, a_offset, first_piece, first_row, state,
                                     accum, partial);
    }
  }

  // One k-block of a tile (its stage full): each piece's wgmma group, waited for and promoted; the
  // stage handed back and the ring advanced. kFirstIssued: piece 0's group is in `partial` already
  // (issue_first, which masked the block's tail too).
  // NOTE: which groups are issued is fixed at compile time: a branch around a group between its
  // issue and its wait (or a select on `partial` there) makes ptxas serialize every wgmma (C7515).
  template <int kPieces, bool kFirstIssued>
  __device__ static void k_block_pieces(const Storage& smem, const GroupedTile& tile, int k_block,
                                        uint32_t a_offset, int first_piece, int first_row,
                                        State& state, float (&accum)[kPieces * kPieceAccumulators],
                                        float (&partial)[kPieceAccumulators]) {
    const int lane_idx = static_cast<int>(threadIdx.x % 32);
    const int warp_in_group = static_cast<int>(threadIdx.x / 32) % 4;
    const int row = first_row + warp_in_group * 16 + lane_idx / 4;  // and row + 8
    const int k_steps = prepare_k_block(smem, tile, k_block, state.index, !kFirstIssued);
    const float a_scale_low = smem.scale_a_stage(state.index)[row];
    const float a_scale_high = smem.scale_a_stage(state.index)[row + 8];
    const uint32_t a_base = ptx::smem_address(smem.a_stage(state.index)) + a_offset;
#pragma unroll
    for (int piece = 0; piece < kPieces; ++piece) {
      // Forward: one B scale per piece; the wgrad reads its column scales when promoting.
      const float b_scale = kWgrad ? 0.0f : smem.scale_b_stage(state.index)[first_piece + piece];
      const uint32_t b_base = ptx::smem_address(smem.b_stage(state.index)) +
                              (first_piece + piece) * Config::kPieceBytes;
      if (!kFirstIssued || piece > 0) {
#pragma unroll
        for (int i = 0; i < kPieceAccumulators; ++i) ptx::fence_operand(partial[i]);
        if constexpr (kWgrad) {
          issue_wgrad_steps(k_steps, a_base, b_base, partial);
        } else {
          issue_k_steps<kKSteps>(a_base, b_base, partial);
        }
        ptx::wgmma_wait_group<0>();
      }
#pragma unroll
      for (int i = 0; i < kPieceAccumulators; ++i) ptx::fence_operand(partial[i]);
      float* piece_accum = accum + piece * kPieceAccumulators;
      if constexpr (kWgrad) {
        // One scale per element, read from the stage: the stage goes back after the last
        // piece's promotion.
        promote_per_column(smem.scale_b_stage(state.index) + (first_piece + piece) * Config::kPiece,
                           lane_idx, a_scale_low, a_scale_high, partial, piece_accum);
        if (piece == kPieces - 1) release_stage(smem, state.index, lane_idx);
      } else {
        // The stage's tiles and scales have been read: hand it back before promoting.
        if (piece == kPieces - 1) release_stage(smem, state.index, lane_idx);
        promote(__fmul_rn(a_scale_low, b_scale), __fmul_rn(a_scale_high, b_scale), partial,
                piece_accum);
      }
    }
    state.advance();
  }

  static constexpr int kKSteps = Config::BLOCK_K / 32;  // wgmma steps of a whole k-block

  // The first kSteps wgmma steps (32 of K each) of one piece, summed into a fresh `partial`: one
  // whole wgmma group, fence to commit.
  template <int kSteps>
  __device__ static void issue_k_steps(uint32_t a_base, uint32_t b_base,
                                       float (&partial)[kPieceAccumulators]) {
    ptx::wgmma_fence();
#pragma unroll
    for (int k32 = 0; k32 < kSteps; ++k32) {
      // K-major: +32 B per 32 k inside the swizzle row.
      const uint64_t desc_a = ptx::make_smem_descriptor(a_base + k32 * 32, 0, 1024);
      const uint64_t desc_b = ptx::make_smem_descriptor(b_base + k32 * 32, 0, 1024);
      Mma::mma(desc_a, desc_b, k32 > 0 ? 1u : 0u, partial);
    }
    ptx::wgmma_commit_group();
  }

  // NOTE: the warp sync orders every lane's shared loads of the stage before lane 0's arrival.
  // On a cluster lane r arrives on CTA r's barrier (whose multicast writes into this CTA's
  // stage), with the plain remote arrive: an explicit .release.cluster slowed the bf16 engine's
  // clustered wgrad (perf-notes/backward.md).
  __device__ static void release_stage(const Storage& smem, int stage, int lane_idx) {
    __syncwarp();
    if constexpr (kClusterSize > 1) {
      if (lane_idx < kClusterSize) {
        ptx::mbarrier_arrive_cluster(&smem.empty[stage], static_cast<uint32_t>(lane_idx));
      }
    } else {
      if (lane_idx == 0) ptx::mbarrier_arrive(&smem.empty[stage]);
    }
  }

  // accum = fma(P, scale, accum), the scale of the fragment's low (row) and high (row + 8) rows.
  __device__ static void promote(float scale_low, float scale_high,
                                 const float (&partial)[kPieceAccumulators], float* accum) {
#pragma unroll
    for (int j = 0; j < kPieceAccumulators / 4; ++j) {
      accum[4 * j + 0] = __fmaf_rn(partial[4 * j + 0], scale_low, accum[4 * j + 0]);
      accum[4 * j + 1] = __fmaf_rn(partial[4 * j + 1], scale_low, accum[4 * j + 1]);
      accum[4 * j + 2] = __fmaf_rn(partial[4 * j + 2], scale_high, accum[4 * j + 2]);
      accum[4 * j + 3] = __fmaf_rn(partial[4 * j + 3], scale_high, accum[4 * j + 3]);
    }
  }

  // The same with a scale per element, fp32(sa[row] · sb[column]): the piece's column scales
  // (kPiece) in shared memory, the thread's pair j at columns 8j + 2(lane % 4) + {0, 1}.
  __device__ static void promote_per_column(const float* column_scales, int lane_idx,
                                            float a_scale_low, float a_scale_high,
                                            const float (&partial)[kPieceAccumulators],
                                            float* accum) {
#pragma unroll
    for (int j = 0; j < kPieceAccumulators / 4; ++j) {
      const float2 b_scale =
          *reinterpret_cast<const float2*>(column_scales + 8 * j + 2 * (lane_idx % 4));
      accum[4 * j + 0] =
          __fmaf_rn(partial[4 * j + 0], __fmul_rn(a_scale_low, b_scale.x), accum[4 * j + 0]);
      accum[4 * j + 1] =
          __fmaf_rn(partial[4 * j + 1], __fmul_rn(a_scale_low, b_scale.y), accum[4 * j + 1]);
      accum[4 * j + 2] =
          __fmaf_rn(partial[4 * j + 2], __fmul_rn(a_scale_high, b_scale.x), accum[4 * j + 2]);
      accum[4 * j + 3] =
          __fmaf_rn(partial[4 * j + 3], __fmul_rn(a_scale_high, b_scale.y), accum[4 * j + 3]);
    }
  }
};

}  // namespace mok::gemm
