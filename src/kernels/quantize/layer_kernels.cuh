// The FP8 layer's own quantizations (precision mode fp8, DESIGN.md §3), beside the general
// quantizers of mok/quantize.hpp, with the same per-element rule (elements.cuh) and so the same
// bytes as the CPU reference's quantize_matrix:
//
//   swiglu_quantize_kernel        h = swiglu(a, b) from the gate/up GEMM's fp32 sums, quantized
//                                 1 x 128 along I straight from fp32 (the reference's rounding
//                                 point: no bf16 rounding of h first); what the gate/up GEMM's
//                                 kSwiGluFp8 epilogue does in registers, kept as its reference
//   GateUpRows                    the row map of quantize_block2d_kernel that takes the gate/up
//                                 weight from gemm::interleave_gate_up's blocks of 8 rows to the
//                                 FP8 GEMM's blocks of 128 (gemm::kSwiGluFp8Interleave), so that
//                                 each 128 x 128 block is a block of W_gate or of W_up alone, as
//                                 the reference quantizes them
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/quantize/elements.cuh"
#include "mok/detail/numerics.hpp"

namespace mok::quantize {

inline constexpr int kLayerQuantizeThreads = 256;

// Data row r of the 128-interleaved gate/up matrix (2I rows: rows 256 b .. 256 b + 127 are gate
// rows 128 b .., the next 128 the same up rows) is read from the 8-interleaved one: gate row g at
// 16 (g / 8) + g % 8, up row u at 16 (u / 8) + 8 + u % 8.
struct GateUpRows {
  __device__ __forceinline__ int64_t operator()(int64_t row, int64_t /*rows*/) const {
    const bool up = row % 256 >= 128;
    const int64_t index = row / 256 * 128 + row % 128;  // the gate or up row
    return index / 8 * 16 + (up ? 8 : 0) + index % 8;
  }
};

// gate_up (rows, 2 * inter) fp32 in the 128-interleaved column order (h column c's gate sum at
// 256 (c / 128) + c % 128, its up sum 128 further) -> h (rows, inter) E4M3 and scales (rows, inter
// / 128) fp32, h = numerics::swiglu(gate, up) (bit-identical to the host's), for the rows below
// *row_bound (device; null: rows). inter a multiple of 128. Any grid of kLayerQuantizeThreads
// threads: a warp per (row, 128-block), four values a lane.
__global__ void __launch_bounds__(kLayerQuantizeThreads)
    swiglu_quantize_kernel(const float* __restrict__ gate_up, uint8_t* __restrict__ h,
                           float* __restrict__ scales, int64_t rows, int64_t inter,
                           const int32_t* __restrict__ row_bound) {
  const int64_t blocks_per_row = inter / 128;
  const int64_t num_rows = row_bound != nullptr ? static_cast<int64_t>(*row_bound) : rows;
  const int64_t num_items = num_rows * blocks_per_row;
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / 32);
  for (int64_t item = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
       item < num_items; item += warps) {  // (the bound is the warp's: no lane leaves alone)
    const int64_t row = item / blocks_per_row;
    const int64_t block = item % blocks_per_row, col = block * 128 + lane * 4;
    const float* sums = gate_up + row * 2 * inter + block * 256 + lane * 4;
    const float4 gate = *reinterpret_cast<const float4*>(sums);
    const float4 up = *reinterpret_cast<const float4*>(sums + 128);
    const float values[4] = {numerics::swiglu(gate.x, up.x), numerics::swiglu(gate.y, up.y),
                             numerics::swiglu(gate.z, up.z), numerics::swiglu(gate.w, up.w)};
    const float amax = __uint_as_float(lanes_max<32>(finite_amax_bits(values)));
    uint32_t words[1];
    encode_scaled(values, block_inverse<Format::kFp8>(amax), words);
    store_codes<4>(h + row * inter + col, words);
    if (lane == 0) store_scale<Format::kFp8>(scales, item, amax);
  }
}

}  // namespace mok::quantize
