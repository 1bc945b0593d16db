// Launchers of the quantize kernels (src/kernels/quantize): mok/quantize.hpp's quantize_gpu. One
// launch per call, on the caller's stream, no host synchronisation.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "kernels/quantize/block2d_kernel.cuh"
#include "kernels/quantize/rowwise_kernel.cuh"
#include "kernels/quantize/transposed_kernel.cuh"
#include "mok/cuda_check.hpp"
#include "mok/error.hpp"
#include "mok/quantize.hpp"

namespace mok::quantize {

namespace {

// A grid of `num_ctas` CTAs, within CUDA's limit of 2^31 - 1.
unsigned grid_of(int64_t num_ctas) {
  MOK_CHECK_ARG(num_ctas < (int64_t{1} << 31), "x", "too large: ", num_ctas,
                " CTAs of the quantize kernel");
  return static_cast<unsigned>(num_ctas);
}

bool aligned(const void* pointer, uintptr_t bytes) {
  return reinterpret_cast<uintptr_t>(pointer) % bytes == 0;
}

template <class Input>
void launch(const Layout& layout, const Input* x, uint8_t* data, void* scales,
            cudaStream_t stream) {
  constexpr int kElements = InputVector<Input>::kElements;
  if (layout.transposed) {
    const int64_t in_rows = layout.input_rows(), in_cols = layout.input_cols();
    const int64_t num_ctas =
        layout.batch * TransposedTile<Input>::tiles_per_matrix(in_rows, in_cols);
    const bool vector_loads = in_cols % kElements == 0;
    if (layout.format == Format::kFp8) {
      quantize_transposed_kernel<Input, Format::kFp8, 128>
          <<<grid_of(num_ctas), kTransposedThreads, 0, stream>>>(x, data, scales, in_rows, in_cols,
                                                                 vector_loads);
    } else {
      quantize_transposed_kernel<Input, Format::kMxfp8, 32>
          <<<grid_of(num_ctas), kTransposedThreads, 0, stream>>>(x, data, scales, in_rows, in_cols,
                                                                 vector_loads);
    }
  } else if (layout.block_rows == kBlock2d) {
    quantize_block2d_kernel<Input><<<grid_of(layout.num_scales()), kBlock2dThreads, 0, stream>>>(
        x, data, static_cast<float*>(scales), layout.rows, layout.cols, layout.scale_rows(),
        layout.scale_cols());
  } else {
    const int64_t num_vectors = layout.num_elements() / kElements;
    int device = 0, num_sms = 0;
    MOK_CUDA_CHECK(cudaGetDevice(&device));
    MOK_CUDA_CHECK(cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, device));
    const int64_t needed = (num_vectors + kRowwiseThreads - 1) / kRowwiseThreads;
    const int num_ctas = static_cast<int>(
        std::max<int64_t>(1, std::min<int64_t>(needed, int64_t{num_sms} * kRowwiseCtasPerSm)));
    if (layout.format == Format::kFp8) {
      quantize_rowwise_kernel<Input, Format::kFp8, 128>
          <<<num_ctas, kRowwiseThreads, 0, stream>>>(x, data, scales, num_vectors);
    } else {
      quantize_rowwise_kernel<Input, Format::kMxfp8, 32>
          <<<num_ctas, kRowwiseThreads, 0, stream>>>(x, data, scales, num_vectors);
    }
  }
  MOK_CUDA_CHECK_LAUNCH();
}

}  // namespace

void quantize_gpu(const Layout& layout, const void* x, InputType input_type, uint8_t* data,
                  void* scales, void* stream) {
  if (layout.num_elements() == 0) return;
  MOK_CHECK_ARG(x != nullptr && data != nullptr && scales != nullptr, "x",
                "null device pointer (x ", x, ", data ", static_cast<void*>(data), ", scales ",
                scales, ")");
  MOK_CHECK_ARG(aligned(x, 16), "x", "device pointer ", x,
                " is not 16-byte aligned (the kernels load 16-byte vectors)");
  MOK_CHECK_ARG(aligned(data, 16), "data", "device pointer ", static_cast<void*>(data),
                " is not 16-byte aligned");
  MOK_CHECK_ARG(aligned(scales, 4), "scales", "device pointer ", scales, " is not 4-byte aligned");
  // The block sizes and the multiple-of-the-block rule are describe()'s; checked again here for
  // layouts built by hand.
  (void)describe(layout.format, layout.batch, layout.input_rows(), layout.input_cols(),
                 layout.block_rows, layout.block_cols, layout.transposed);
  auto* cuda_stream = static_cast<cudaStream_t>(stream);
  if (input_type == InputType::kBf16) {
    launch(layout, static_cast<const uint16_t*>(x), data, scales, cuda_stream);
  } else {
    MOK_CHECK_ARG(input_type == InputType::kFp32, "x", "unknown input type ",
                  static_cast<int32_t>(input_type));
    launch(layout, static_cast<const float*>(x), data, scales, cuda_stream);
  }
}

}  // namespace mok::quantize
