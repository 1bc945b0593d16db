// How both GEMM engines' epilogues write bf16 results: one warp's 16 fragment rows at a time.
//
// The warp's (16, kColumns) slice of wgmma's fragment (fragment.cuh) is rounded to bf16 pairs,
// staged in the warp's own 16 staging rows, 128 output columns (one pass) at a time, then copied
// out with 16-byte loads and stores, whole rows side by side, so every store instruction writes
// full 32-byte sectors of one to four rows. The stores are ordinary (generic proxy) global stores.
//
// They replaced one bulk copy per row: a `cp.async.bulk` takes its addresses from uniform
// registers, so a warp issues its rows' copies one lane at a time, and the TMA unit, which also
// serves the producer's loads, works through them one by one (perf-notes/gemm.md).
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/gemm/gemm_types.cuh"

namespace mok::gemm {

// kColumns: the warp's fragment columns (accumulator pairs accum[0, kColumns / 2)); kSwiGlu: the
// outputs are swiglu_in_place's h, one per gate/up pair, so kColumns / 2 bf16 columns.
template <int kColumns, bool kSwiGlu>
struct WarpRows {
  static constexpr int kOutVectors = (kSwiGlu ? kColumns / 2 : kColumns) / 8;  // bf16 x 8 each
  static constexpr int kPacked = 2 * kOutVectors;  // bf16 pairs per thread
  static constexpr int kPassVectors = kStagingRowBytes / 16;
  static constexpr int kPasses = (kOutVectors + kPassVectors - 1) / kPassVectors;
  static_assert(kOutVectors < kPassVectors || kOutVectors % kPassVectors == 0, "whole passes");
  static constexpr int kVectors =
      kOutVectors < kPassVectors ? kOutVectors : kPassVectors;  // a pass's
  static_assert(32 % kVectors == 0, "a warp copies whole rows at a time");
  static constexpr int kRowsAtOnce = 32 / kVectors;
  // The copy loop of plain outputs is unrolled, so that a lane's staged loads are in flight
  // together (faster in the fused forward at deepseek-v3, perf-notes/layer.md); for SwiGLU outputs
  // the same unroll made the SwiGLU GEMM slower (its cost over the plain one went up), so that loop
  // stays rolled.
  static constexpr int kCopyUnroll = kSwiGlu ? 1 : 16 / kRowsAtOnce;

  // The bf16 output pairs of accum[0, kColumns / 2) in fragment order: packed[2 o + half] is
  // output vector o (8 columns) of fragment row lane / 4 + 8 half. Plain outputs: pair
  // (4 j + 2 half, + 1) of fragment block j; SwiGLU: the h of gate block 2 o.
  template <int kSize>
  __device__ static void pack(const float (&accum)[kSize], uint32_t (&packed)[kPacked]) {
    static_assert(kColumns / 2 <= kSize, "the accumulators hold the columns");
#pragma unroll
    for (int j = 0; j < kColumns / 8; j += kSwiGlu ? 2 : 1) {
      const int out_vector = kSwiGlu ? j / 2 : j;
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int index = 4 * j + 2 * half;
        const __nv_bfloat162 pair = __floats2bfloat162_rn(accum[index], accum[index + 1]);
        packed[2 * out_vector + half] = *reinterpret_cast<const uint32_t*>(&pair);
      }
    }
  }

  // Writes the warp's rows. destination(i), called by lane i < 16 once the first pass is staged
  // (fewer output registers are live then; a destination may need registers of its own, as the
  // fused combine's owner lookup does), gives where the warp's row i starts (its first output
  // column) or null for a row not to write. Output columns past columns_valid are not written.
  template <class Destination>
  __device__ static void write(uint8_t* warp_staging, const uint32_t (&packed)[kPacked],
                               int columns_valid, const Destination& destination) {
    const int lane_idx = static_cast<int>(threadIdx.x % 32);
    char* row_start = nullptr;
#pragma unroll
    for (int pass = 0; pass < kPasses; ++pass) {
      __syncwarp();  // the previous pass's (or tile's) rows have been read
      stage_pass(warp_staging, pass, lane_idx, packed);
      if (pass == 0 && lane_idx < 16) row_start = destination(lane_idx);
      __syncwarp();
      const int vector = lane_idx % kVectors;
      const int column = 8 * (pass * kPassVectors + vector);
#pragma unroll kCopyUnroll
      for (int first = 0; first < 16; first += kRowsAtOnce) {
        const int row = first + lane_idx / kVectors;
        const uint4 value = *reinterpret_cast<const uint4*>(warp_staging + row * kStagingRowBytes +
                                                            staged_vector_offset(row, vector));
        char* row_destination = reinterpret_cast<char*>(
            __shfl_sync(0xffffffffu, reinterpret_cast<uintptr_t>(row_start), row));
        if (row_destination != nullptr && column < columns_valid) {
          *reinterpret_cast<uint4*>(row_destination + column * 2) = value;
        }
      }
    }
  }

 private:
  // Where 16-byte vector `vector` of staged row `row` lies in the row: the vectors of the warp's 8
  // fragment rows are XOR-swizzled, so that a fragment store (8 rows, one vector each) hits every
  // bank once.
  __device__ static uint32_t staged_vector_offset(int row, int vector) {
    return static_cast<uint32_t>((vector ^ (row % 8)) * 16);
  }

  // Stages the pairs of pass `pass` (output vectors [pass, pass + 1) * kPassVectors).
  __device__ static void stage_pass(uint8_t* warp_staging, int pass, int lane_idx,
                                    const uint32_t (&packed)[kPacked]) {
    const int quad_byte = 4 * (lane_idx % 4);
#pragma unroll
    for (int out_vector = 0; out_vector < kOutVectors; ++out_vector) {
      if (out_vector / kPassVectors != pass) continue;
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int row = lane_idx / 4 + 8 * half;
        *reinterpret_cast<uint32_t*>(warp_staging + row * kStagingRowBytes +
                                     staged_vector_offset(row, out_vector % kPassVectors) +
                                     quad_byte) = packed[2 * out_vector + half];
      }
    }
  }
};

}  // namespace mok::gemm
