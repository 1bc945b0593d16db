// torch custom ops over mok/quantize.hpp: mok::fp8_quantize, mok::mxfp8_quantize (CPU: the core's
// quantize_cpu; CUDA: quantize_gpu on the current stream, the same bytes) and mok::dequantize
// (CPU). Data comes back as uint8 E4M3 codes, scales as fp32 (fp8) or uint8 E8M0 codes (mxfp8);
// python/mok/ops.py views them as torch's float8 dtypes and holds the fake implementations.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstdint>
#include <exception>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "mok/quantize.hpp"
#include "torch_args.hpp"

#if defined(MOK_TORCH_WITH_CUDA)
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace mok::torch_ops {

namespace {

using Quantized = std::tuple<Tensor, Tensor>;
using quantize::Format;
using quantize::Layout;

// Runs `body`; a core error (mok::Error, a std::runtime_error) becomes a Python ValueError with
// the core's message.
template <class Body>
auto quantize_errors_as_value_errors(Body&& body) {
  try {
    return body();
  } catch (const c10::Error&) {
    throw;
  } catch (const std::exception& error) {
    TORCH_CHECK_VALUE(false, std::string(error.what()));
    throw;  // not reached
  }
}

int64_t product(at::IntArrayRef sizes) {
  int64_t count = 1;
  for (int64_t size : sizes) count *= size;
  return count;
}

// The layout of quantizing x with (block_rows x block_cols) blocks of the data, and the data's and
// the scales' shapes: x's leading dimensions are kept; rowwise blocks treat every dimension but
// the last as rows, the others the last two as a matrix (transposed: (.., M, N) -> (.., N, M)).
struct Plan {
  Layout layout;
  std::vector<int64_t> data_sizes;
  std::vector<int64_t> scale_sizes;
};

Plan plan(at::IntArrayRef sizes, Format format, int64_t block_rows, int64_t block_cols,
          bool transposed) {
  const bool rowwise = block_rows == 1 && !transposed;
  MOK_TORCH_CHECK(sizes.size() >= (rowwise ? 1u : 2u), "x: expected at least ", rowwise ? 1 : 2,
                  " dimensions, got ", sizes.size());
  const size_t num_dims = sizes.size();
  int64_t batch = 1, rows = 0;
  if (rowwise) {
    rows = product(sizes.slice(0, num_dims - 1));
  } else {
    batch = product(sizes.slice(0, num_dims - 2));
    rows = sizes[num_dims - 2];
  }
  Plan result;
  result.layout =
      quantize::describe(format, batch, rows, sizes.back(), static_cast<int32_t>(block_rows),
                         static_cast<int32_t>(block_cols), transposed);
  result.data_sizes.assign(sizes.begin(), sizes.end());
  if (transposed) std::swap(result.data_sizes[num_dims - 1], result.data_sizes[num_dims - 2]);
  result.scale_sizes = result.data_sizes;
  result.scale_sizes.back() = result.layout.scale_cols();
  if (!rowwise) result.scale_sizes[num_dims - 2] = result.layout.scale_rows();
  return result;
}

quantize::InputType input_type(const Tensor& x) {
  return x.scalar_type() == at::kFloat ? quantize::InputType::kFp32 : quantize::InputType::kBf16;
}

Quantized quantize_tensor(const Tensor& x_in, Format format, int64_t block_rows, int64_t block_cols,
                          bool transposed) {
  return quantize_errors_as_value_errors([&] {
    MOK_TORCH_CHECK(x_in.defined(), "x: tensor is undefined");
    MOK_TORCH_CHECK(x_in.scalar_type() == at::kBFloat16 || x_in.scalar_type() == at::kFloat,
                    "x: expected dtype bfloat16 or float32, got ",
                    c10::toString(x_in.scalar_type()));
    const Plan p = plan(x_in.sizes(), format, block_rows, block_cols, transposed);
    Tensor x = x_in.contiguous();
    const at::TensorOptions bytes = x.options().dtype(at::kByte);
    Tensor data = at::empty(p.data_sizes, bytes);
    Tensor scales =
        at::empty(p.scale_sizes, format == Format::kFp8 ? x.options().dtype(at::kFloat) : bytes);
    if (x.device().is_cpu()) {
      quantize::quantize_cpu(p.layout, x.data_ptr(), input_type(x),
                             static_cast<uint8_t*>(data.data_ptr()), scales.data_ptr());
      return Quantized{data, scales};
    }
#if defined(MOK_TORCH_WITH_CUDA)
    MOK_TORCH_CHECK(x.device().is_cuda(), "x: expected a CPU or CUDA tensor, got one on ",
                    x.device().str());
    const c10::cuda::CUDAGuard device_guard(x.device());
    // A view at an odd storage offset: the kernels load 16-byte vectors.
    if (reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 != 0) x = x.clone();
    quantize::quantize_gpu(p.layout, x.data_ptr(), input_type(x),
                           static_cast<uint8_t*>(data.data_ptr()), scales.data_ptr(),
                           c10::cuda::getCurrentCUDAStream(x.device().index()).stream());
    return Quantized{data, scales};
#else
    MOK_TORCH_CHECK(false, "x: on ", x.device().str(),
                    ", but this build of mok has no CUDA quantizer (CPU tensors only)");
    return Quantized{};
#endif
  });
}

Quantized fp8_quantize_op(const Tensor& x, int64_t block_rows, int64_t block_cols,
                          bool transposed) {
  return quantize_tensor(x, Format::kFp8, block_rows, block_cols, transposed);
}

Quantized mxfp8_quantize_op(const Tensor& x, bool transposed) {
  return quantize_tensor(x, Format::kMxfp8, 1, 32, transposed);
}

// data (.., rows, cols) uint8 E4M3 codes in the data's own layout; scales fp32 (fp8) or uint8
// (mxfp8, E8M0) of (.., scale_rows, scale_cols) for 128 x 128 blocks, (.., scale_cols) else.
Tensor dequantize_op(const Tensor& data_in, const Tensor& scales_in, int64_t block_rows,
                     int64_t block_cols) {
  return quantize_errors_as_value_errors([&] {
    MOK_TORCH_CHECK(data_in.defined() && data_in.scalar_type() == at::kByte,
                    "data: expected uint8 E4M3 codes");
    MOK_TORCH_CHECK(scales_in.defined() && (scales_in.scalar_type() == at::kFloat ||
                                            scales_in.scalar_type() == at::kByte),
                    "scales: expected float32 (fp8) or uint8 E8M0 codes (mxfp8)");
    MOK_TORCH_CHECK(data_in.device().is_cpu() && scales_in.device().is_cpu(),
                    "data, scales: mok::dequantize runs on CPU tensors (mok.ops.*_dequantize ",
                    "handles every device)");
    const Format format = scales_in.scalar_type() == at::kFloat ? Format::kFp8 : Format::kMxfp8;
    const Plan p = plan(data_in.sizes(), format, block_rows, block_cols, false);
    MOK_TORCH_CHECK(scales_in.sizes().equals(p.scale_sizes), "scales: shape ",
                    shape_text(scales_in.sizes()), ", expected ",
                    shape_text(at::IntArrayRef(p.scale_sizes)), " for data of shape ",
                    shape_text(data_in.sizes()));
    const Tensor data = data_in.contiguous(), scales = scales_in.contiguous();
    Tensor out = at::empty(data.sizes(), data.options().dtype(at::kFloat));
    quantize::dequantize_cpu(p.layout, static_cast<const uint8_t*>(data.data_ptr()),
                             scales.data_ptr(), out.data_ptr<float>());
    return out;
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(mok, m) {
  m.def(
      "fp8_quantize(Tensor x, int block_rows=1, int block_cols=128, bool transposed=False) -> "
      "(Tensor, Tensor)");
  m.def("mxfp8_quantize(Tensor x, bool transposed=False) -> (Tensor, Tensor)");
  m.def("dequantize(Tensor data, Tensor scales, int block_rows, int block_cols) -> Tensor");
}

TORCH_LIBRARY_IMPL(mok, CPU, m) {
  m.impl("fp8_quantize", &fp8_quantize_op);
  m.impl("mxfp8_quantize", &mxfp8_quantize_op);
  m.impl("dequantize", &dequantize_op);
}

#if defined(MOK_TORCH_WITH_CUDA)
TORCH_LIBRARY_IMPL(mok, CUDA, m) {
  m.impl("fp8_quantize", &fp8_quantize_op);
  m.impl("mxfp8_quantize", &mxfp8_quantize_op);
}
#endif

}  // namespace mok::torch_ops
