// Blocks of 1 x kBlock along the contiguous dimension (fp8: 128, mxfp8: 32). The data and the
// input share one flat order and every block is kBlock consecutive elements, so a block is
// kBlock / kElements consecutive threads, each holding one 16-byte input vector; the block's
// amax goes round those lanes by shuffles.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/quantize/elements.cuh"

namespace mok::quantize {

// num_vectors: the input's elements / kElements. Launched with 256 threads per CTA and any grid.
// row_bound, when given: only the rows below *row_bound (read on the device) of rows of
// vectors_per_row vectors (the FP8 layer's dispatched rows, runtime/layer_forward_fp8.cu).
template <class Input, Format kFormat, int kBlock>
__global__ void __launch_bounds__(256)
    quantize_rowwise_kernel(const Input* __restrict__ x, uint8_t* __restrict__ data,
                            void* __restrict__ scales, int64_t num_vectors,
                            const int32_t* __restrict__ row_bound = nullptr,
                            int64_t vectors_per_row = 0) {
  constexpr int kElements = InputVector<Input>::kElements;
  constexpr int kLanesPerBlock = kBlock / kElements;
  static_assert(kLanesPerBlock >= 1 && kLanesPerBlock <= 32 && 32 % kLanesPerBlock == 0,
                "a block is a power-of-two group of lanes within a warp");
  if (row_bound != nullptr) {
    num_vectors = min(num_vectors, static_cast<int64_t>(*row_bound) * vectors_per_row);
  }
  // Whole warps run every iteration (the shuffles need all lanes), so the loop bound is the
  // vector count rounded up to a warp; lanes past the end only take part in the shuffles.
  const int64_t num_warp_vectors = (num_vectors + 31) / 32 * 32;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t vector_idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       vector_idx < num_warp_vectors; vector_idx += stride) {
    const bool active = vector_idx < num_vectors;
    float values[kElements] = {};  // (kElements,)
    if (active) InputVector<Input>::load(x + vector_idx * kElements, values);
    const float amax = __uint_as_float(lanes_max<kLanesPerBlock>(finite_amax_bits(values)));
    if (!active) continue;
    uint32_t words[kElements / 4];
    encode_scaled(values, block_inverse<kFormat>(amax), words);
    store_codes<kElements>(data + vector_idx * kElements, words);
    if (vector_idx % kLanesPerBlock == 0)
      store_scale<kFormat>(scales, vector_idx / kLanesPerBlock, amax);
  }
}

}  // namespace mok::quantize
