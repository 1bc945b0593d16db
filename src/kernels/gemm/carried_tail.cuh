// Carried tails: the few rows of an expert's last row block (at most kRows), multiplied by the
// tile of the block before it, as Cᵀ = W · Xᵀ beside that tile's own MMAs, so that wgmma's N,
// which steps by 8, runs over the rows instead of its M, which is 64.
//
// On its own, such a block is a half tile (is_half_tile) that streams the whole weight tile through
// its stages to multiply 64 rows, most of them padding: with balanced routing (no tails) the fused
// forward ran faster at deepseek-v3 EP1 and EP2 (docs/perf-notes/layer.md), and random routing
// leaves most experts a tail. As a tile of its own with these narrow MMAs it was slower still (each
// k16 step of a narrow wgmma waits for the one before). Beside a full tile's m64n256 MMAs, the
// weight tile is already in the stages and the narrow MMAs' latency hides.
//
// kRows is 8 (m64n8, 8 more accumulators a consumer thread): with 16, ptxas serialised every
// wgmma of the fused kernel for want of registers (C7512), the tile's 128 accumulators beside.
//
// The stages hold the full tile's A (128 rows, K-major) and B (256 weight rows, K-major), and the
// tail's kRows rows in a stage of their own (the same 128-byte swizzled K-major layout). Either
// operand of wgmma may be K-major, so only the roles change: consumer c multiplies weight rows
// 128 c + 64 s (s = 0, 1: two m64 slices) by the tail's rows, with wgmma m64n{kRows}k16. Each
// output element is the same sum of the same products over the same k16 steps in the same order
// as in a normal tile (wgmma's shape does not change an element; the fused GPU tests compare with
// the unfused path bitwise).
//
// The tail's epilogue writes from registers: the fragment's rows are output columns, its columns
// output rows, so a warp's store covers 8 adjacent columns of 4 rows.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/gemm/epilogue.cuh"
#include "kernels/gemm/gemm_types.cuh"
#include "kernels/gemm/swiglu.cuh"
#include "kernels/gemm/tile_scheduler.cuh"
#include "kernels/ptx/barrier.cuh"
#include "kernels/ptx/wgmma.cuh"
#include "mok/detail/numerics.hpp"

namespace mok::gemm {

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900

// kRows: wgmma's N, the rows one carrier takes.
template <int kRows>
struct CarriedTail {
  using Mma = ptx::Wgmma64x8<0, 0>;
  static_assert(Mma::kN == kRows, "wgmma N = the rows (m64n8 only: see above)");
  static constexpr int kSlice = Mma::kNumAccumulators;  // accumulators of one m64 slice
  static constexpr int kSlices = 2;                     // per consumer: 128 weight rows
  static constexpr int kAccumulators = kSlices * kSlice;

  // The tail's MMAs of one k16 step (the mainloop's `beside`): consumer c multiplies weight rows
  // 128 c + 64 s of the stage's B (128-byte rows, so whole 1024-byte swizzle atoms) by the
  // stage's tail rows.
  template <class Storage>
  struct TailMmas {
    const Storage& smem;
    uint32_t tail_base;  // shared address of stage 0's tail rows
    uint32_t tail_stage_bytes;
    int consumer_idx;
    float (&tail)[kAccumulators];

    __device__ void fence() const {
#pragma unroll
      for (int i = 0; i < kAccumulators; ++i) ptx::fence_operand(tail[i]);
    }
    __device__ void issue(int stage, int k16) const {
      const uint32_t weights = ptx::smem_address(smem.b_stage(stage)) +
                               static_cast<uint32_t>(consumer_idx) * 128 * 128 + k16 * 32;
      const uint64_t rows_desc = ptx::make_smem_descriptor(
          tail_base + static_cast<uint32_t>(stage) * tail_stage_bytes + k16 * 32, 0, 1024);
#pragma unroll
      for (int s = 0; s < kSlices; ++s) {
        Mma::mma(ptx::make_smem_descriptor(weights + s * 64 * 128, 0, 1024), rows_desc, 1u,
                 reinterpret_cast<float(&)[kSlice]>(tail[s * kSlice]));
      }
    }
    __device__ void after_second_group() const {}
  };

  // Consumer side, for a forward tile that carries a tail: the cooperative mainloop's k-loop
  // (Loop: mainloop.cuh, this warpgroup's 64 rows by the whole weight tile into accum) with the
  // tail's MMAs beside it (tail[s * kSlice, (s + 1) * kSlice) = slice s). tail_stages: kRows rows
  // of A per stage, tail_stage_bytes apart.
  template <class Loop>
  __device__ static void mma_beside_full_tile(const typename Loop::Storage& smem,
                                              const uint8_t* tail_stages, uint32_t tail_stage_bytes,
                                              const GroupedGemmParams& params,
                                              const GroupedTile& tile, int consumer_idx,
                                              typename Loop::State& state,
                                              float (&accum)[TileConfig::BLOCK_N / 2],
                                              float (&tail)[kAccumulators]) {
#pragma unroll
    for (int i = 0; i < kAccumulators; ++i) tail[i] = 0.0f;
    const TailMmas<typename Loop::Storage> beside{smem, ptx::smem_address(tail_stages),
                                                  tail_stage_bytes, consumer_idx, tail};
    Loop::mma_full_tile_with(smem, params, tile, consumer_idx, state, accum, beside);
  }

  // The tail's bf16 results (SwiGLU's h, or the plain outputs) to row_destination's rows, as
  // Epilogue<kForward, kEpilogue>::store would write them (`tile`: the tail block's; the
  // fragment's columns are its rows first_row on). accum (the tail's accumulators) is
  // overwritten.
  template <EpilogueKind kEpilogue, class RowDestination, int kSize>
  __device__ static void store(const GroupedGemmParams& params, const GroupedTile& tile,
                               int first_row, int consumer_idx, float (&accum)[kSize],
                               const RowDestination& row_destination) {
    static_assert(kEpilogue == EpilogueKind::kSwiGluBf16 || kEpilogue == EpilogueKind::kStoreBf16,
                  "bf16 outputs");
    constexpr bool kSwiGlu = kEpilogue == EpilogueKind::kSwiGluBf16;
    // Fragment row 16 w + l/4 (+ 8) of slice s is weight row 128 c + 64 s + 16 w + l/4 (+ 8),
    // accum[s * kSlice + 4 j + e] (+ 2) at fragment column 8 j + 2 (l%4) + e. In the gate/up
    // weight (gate and up rows interleaved by 8) the first row is a gate row and the second the
    // up row of the same h column: h overwrites the gate's accumulator.
    if constexpr (kSwiGlu) {
      // visit(i) for each gate accumulator accum[i] (its up: accum[i + 2]).
      const auto for_each_gate = [](auto&& visit) {
#pragma unroll
        for (int s = 0; s < kSlices; ++s) {
#pragma unroll
          for (int j = 0; j < kRows / 8; ++j) {
#pragma unroll
            for (int e = 0; e < 2; ++e) visit(s * kSlice + 4 * j + e);
          }
        }
      };
      bool all_fast = true;
      for_each_gate([&](int gate) { all_fast &= swiglu_gate_is_fast(accum[gate]); });
      for_each_gate([&](int gate) {
        accum[gate] = all_fast ? swiglu_fast(accum[gate], accum[gate + 2])
                               : numerics::swiglu(accum[gate], accum[gate + 2]);
      });
    }
    using Fragment = typename Epilogue<GemmKind::kForward, kEpilogue>::Fragment;
    Fragment f{};
    static_cast<TileInC&>(f) = tile_in_c<GemmKind::kForward, kEpilogue, TileConfig>(params, tile);
    const int warp_in_group = static_cast<int>(threadIdx.x / 32) % 4;
    const int lane_idx = static_cast<int>(threadIdx.x % 32);
    const int weight_row = consumer_idx * 128 + warp_in_group * 16 + lane_idx / 4;
#pragma unroll
    for (int j = 0; j < kRows / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int row = first_row + 8 * j + 2 * (lane_idx % 4) + e;  // the fragment's column
        if (row >= f.rows_valid) continue;
        char* destination = row_destination(f, tile, row);
#pragma unroll
        for (int s = 0; s < kSlices; ++s) {
          const int first = weight_row + 64 * s;
          if constexpr (kSwiGlu) {
            // gate rows 16 b .. 16 b + 7 hold h columns 8 b .. 8 b + 7
            const int column = first / 16 * 8 + first % 8;
            if (column < f.columns_valid) {
              *reinterpret_cast<__nv_bfloat16*>(destination + column * 2) =
                  __float2bfloat16_rn(accum[s * kSlice + 4 * j + e]);
            }
          } else {
#pragma unroll
            for (int half = 0; half < 2; ++half) {
              const int column = first + 8 * half;
              if (column < f.columns_valid) {
                *reinterpret_cast<__nv_bfloat16*>(destination + column * 2) =
                    __float2bfloat16_rn(accum[s * kSlice + 4 * j + 2 * half + e]);
              }
            }
          }
        }
      }
    }
  }
};

#endif  // __CUDA_ARCH__ >= 900

}  // namespace mok::gemm
