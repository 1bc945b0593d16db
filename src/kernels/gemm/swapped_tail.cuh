// Swapped tail tiles: a forward tile whose row block holds only a few of its expert's rows (the
// last block of an expert, at most kSwappedTailMaxRows rows) computed as Cᵀ = W · Xᵀ, so that
// wgmma's N, which steps by 8, runs over the rows instead of its M, which is 64.
//
// A normal tile multiplies at least 64 rows (a half tile, is_half_tile): for an expert with a
// few rows past a multiple of 128, up to 63 rows of padding are multiplied with the weights. With
// balanced routing (no tails) the fused forward ran 13 % faster at deepseek-v3 EP1 and 8 % at EP2
// (docs/perf-notes/layer.md v34): random routing leaves most experts a tail of a few rows.
//
// The stages hold what the producer loads for any tile (tile_loader.cuh): A, the block's 128 rows
// (K-major), and B, the 256 weight rows of the column block (K-major). Both are K-major with the
// 128-byte swizzle, which is what wgmma wants of either operand, so only the roles change:
// consumer c multiplies weight rows 128 c + 64 s (s = 0, 1: two m64 slices) by the first kRows
// rows of A, with wgmma m64n{kRows}k16. Each output element is the same sum of the same products
// over the same k16 steps in the same order as in a normal tile (wgmma's shape does not change an
// element; the fused GPU tests compare with the unfused path bitwise).
//
// The epilogue writes from registers: the fragment's rows are output columns, its columns output
// rows, so a warp's store covers 8 adjacent columns of 4 rows.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>
#include <type_traits>

#include "kernels/gemm/epilogue.cuh"
#include "kernels/gemm/gemm_types.cuh"
#include "kernels/gemm/swiglu.cuh"
#include "kernels/ptx/barrier.cuh"
#include "kernels/ptx/wgmma.cuh"
#include "kernels/schedule/tile_scheduler.cuh"
#include "mok/detail/numerics.hpp"

namespace mok::gemm {

inline constexpr int kSwappedTailMaxRows = 32;

// A forward tile that SwappedTail computes: its block holds at most kSwappedTailMaxRows rows.
__host__ __device__ inline bool is_swapped_tail(const GroupedTile& tile) {
  return tile.row_count - tile.m_block * TileConfig::BLOCK_M <= kSwappedTailMaxRows;
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900

// kRows: wgmma's N, 16 or 32 (the block's rows rounded up).
template <int kRows>
struct SwappedTail {
  using Mma = std::conditional_t<kRows == 16, ptx::Wgmma64x16<0, 0>, ptx::Wgmma64x32<0, 0>>;
  static_assert(Mma::kN == kRows, "wgmma N = the rows");
  static constexpr int kSlice = Mma::kNumAccumulators;  // accumulators of one m64 slice
  static constexpr int kSlices = 2;                      // per consumer: 128 weight rows

  // Consumer side: the k-loop, accum[s * kSlice, (s + 1) * kSlice) = slice s.
  template <class Storage, class State, int kSize>
  __device__ static void mma(const Storage& smem, const GroupedGemmParams& params,
                             int consumer_idx, State& state, float (&accum)[kSize]) {
    static_assert(kSlices * kSlice <= kSize, "the accumulators hold both slices");
    const int lane_idx = static_cast<int>(threadIdx.x % 32);
    const int num_blocks = ceil_div(params.k, TileConfig::BLOCK_K);
#pragma unroll
    for (int i = 0; i < kSlices * kSlice; ++i) accum[i] = 0.0f;
    // Weight rows 128 c + 64 s: 128-byte rows, so whole 1024-byte swizzle atoms.
    const uint32_t weight_offset = static_cast<uint32_t>(consumer_idx) * 128 * 128;
    for (int k_block = 0; k_block < num_blocks; ++k_block) {
      ptx::mbarrier_wait(&smem.full[state.index], state.phase);
      const uint32_t rows_base = ptx::smem_address(smem.a_stage(state.index));
      const uint32_t weights_base = ptx::smem_address(smem.b_stage(state.index)) + weight_offset;
#pragma unroll
      for (int i = 0; i < kSlices * kSlice; ++i) ptx::fence_operand(accum[i]);
      ptx::wgmma_fence();
#pragma unroll
      for (int k16 = 0; k16 < TileConfig::BLOCK_K / 16; ++k16) {
        const uint64_t rows = ptx::make_smem_descriptor(rows_base + k16 * 32, 0, 1024);
#pragma unroll
        for (int s = 0; s < kSlices; ++s) {
          const uint64_t weights =
              ptx::make_smem_descriptor(weights_base + s * 64 * 128 + k16 * 32, 0, 1024);
          Mma::mma(weights, rows, 1u, reinterpret_cast<float(&)[kSlice]>(accum[s * kSlice]));
        }
      }
      ptx::wgmma_commit_group();
      ptx::wgmma_wait_group<0>();
#pragma unroll
      for (int i = 0; i < kSlices * kSlice; ++i) ptx::fence_operand(accum[i]);
      if (lane_idx == 0) ptx::mbarrier_arrive(&smem.empty[state.index]);
      state.advance();
    }
  }

  // The tile's bf16 results (SwiGLU's h, or the plain outputs) to row_destination's rows, as
  // Epilogue<kForward, kEpilogue>::store would write them. accum is overwritten.
  template <EpilogueKind kEpilogue, class RowDestination, int kSize>
  __device__ static void store(const GroupedGemmParams& params, const GroupedTile& tile,
                               int consumer_idx, float (&accum)[kSize],
                               const RowDestination& row_destination) {
    static_assert(kEpilogue == EpilogueKind::kSwiGluBf16 || kEpilogue == EpilogueKind::kStoreBf16,
                  "bf16 outputs");
    constexpr bool kSwiGlu = kEpilogue == EpilogueKind::kSwiGluBf16;
    // Fragment row 16 w + l/4 (+ 8) of slice s is weight row 128 c + 64 s + 16 w + l/4 (+ 8),
    // accum[s * kSlice + 4 j + e] (+ 2) at fragment column 8 j + 2 (l%4) + e. In the gate/up
    // weight (gate and up rows interleaved by 8) the first row is a gate row and the second the
    // up row of the same h column: h overwrites the gate's accumulator.
    if constexpr (kSwiGlu) {
      bool all_fast = true;
#pragma unroll
      for (int s = 0; s < kSlices; ++s) {
#pragma unroll
        for (int j = 0; j < kRows / 8; ++j) {
#pragma unroll
          for (int e = 0; e < 2; ++e) all_fast &= accum[s * kSlice + 4 * j + e] > kFastSwiGluGateFloor;
        }
      }
#pragma unroll
      for (int s = 0; s < kSlices; ++s) {
#pragma unroll
        for (int j = 0; j < kRows / 8; ++j) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            float& gate = accum[s * kSlice + 4 * j + e];
            const float up = accum[s * kSlice + 4 * j + 2 + e];
            gate = all_fast ? swiglu_fast(gate, up) : numerics::swiglu(gate, up);
          }
        }
      }
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
        const int row = 8 * j + 2 * (lane_idx % 4) + e;  // the fragment's column
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
