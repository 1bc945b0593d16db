// torch custom ops over the C++ core: mok::forward and mok::backward. CPU tensors run the CPU
// backend (one rank); the fake (meta) implementations and autograd live in python/mok/_ops.py.
// Argument errors become Python ValueErrors carrying the core's message.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

#include "mok/reference.hpp"

namespace mok::torch_ops {

namespace {

// Every message is built by mok::detail::concat and handed to torch as one string: torch's own
// multi-argument formatting would instantiate iostreams inside this library (see error.hpp).
#define MOK_TORCH_CHECK(condition, ...) TORCH_CHECK_VALUE(condition, ::mok::detail::concat(__VA_ARGS__))

using at::Tensor;
using OptionalTensor = std::optional<Tensor>;

// A checked, contiguous CPU tensor of `dtype`, viewed as mok::View<T>.
template <class T>
View<const T> view_of(const Tensor& tensor, const char* argument, at::ScalarType dtype) {
  MOK_TORCH_CHECK(tensor.defined(), argument, ": tensor is undefined");
  MOK_TORCH_CHECK(tensor.scalar_type() == dtype, argument, ": expected dtype ", c10::toString(dtype),
                  ", got ", c10::toString(tensor.scalar_type()));
  MOK_TORCH_CHECK(tensor.device().is_cpu(), argument, ": expected a CPU tensor, got one on ",
                  tensor.device().str());
  MOK_TORCH_CHECK(tensor.is_contiguous(), argument, ": expected a contiguous tensor");
  return View<const T>(static_cast<const T*>(tensor.data_ptr()),
                       std::vector<int64_t>(tensor.sizes().begin(), tensor.sizes().end()));
}

View<const bf16> bf16_view(const Tensor& tensor, const char* argument) {
  return view_of<bf16>(tensor, argument, at::kBFloat16);
}

template <class T>
View<T> mutable_view(const Tensor& tensor) {
  return View<T>(static_cast<T*>(tensor.data_ptr()),
                 std::vector<int64_t>(tensor.sizes().begin(), tensor.sizes().end()));
}

struct LayerArgs {
  LayerShape shape;
  Tensor topk_idx;  // int32, contiguous (converted from int64 when needed)
  reference::RankInputs inputs;
};

LayerArgs layer_args(const Tensor& x, const Tensor& topk_idx, const Tensor& topk_w,
                     const Tensor& w_gate, const Tensor& w_up, const Tensor& w_down,
                     const OptionalTensor& w_shared_gate, const OptionalTensor& w_shared_up,
                     const OptionalTensor& w_shared_down) {
  MOK_TORCH_CHECK(x.dim() == 2, "x: expected (T, H), got ", x.dim(), " dimensions");
  MOK_TORCH_CHECK(w_gate.dim() == 3, "w_gate: expected (E, I, H), got ", w_gate.dim(), " dimensions");
  MOK_TORCH_CHECK(topk_idx.dim() == 2, "topk_idx: expected (T, k), got ", topk_idx.dim(), " dimensions");
  MOK_TORCH_CHECK(topk_idx.scalar_type() == at::kInt || topk_idx.scalar_type() == at::kLong,
                  "topk_idx: expected dtype int32 or int64, got ", c10::toString(topk_idx.scalar_type()));
  const bool has_shared = w_shared_gate.has_value() && w_shared_gate->defined();
  MOK_TORCH_CHECK(has_shared == (w_shared_up.has_value() && w_shared_up->defined()) &&
                      has_shared == (w_shared_down.has_value() && w_shared_down->defined()),
                  "w_shared_gate, w_shared_up, w_shared_down: give all three or none");

  LayerArgs args;
  args.shape = {x.size(1), w_gate.size(1), has_shared ? w_shared_gate->size(0) : 0, w_gate.size(0),
                topk_idx.size(1)};
  if (topk_idx.scalar_type() == at::kLong && topk_idx.numel() > 0) {
    const int64_t low = topk_idx.min().item<int64_t>(), high = topk_idx.max().item<int64_t>();
    MOK_TORCH_CHECK(low >= -1 && high < args.shape.num_experts, "topk_idx: expert id ",
                    low < -1 ? low : high, " out of range [0, ", args.shape.num_experts, ")");
  }
  args.topk_idx = topk_idx.to(at::kInt).contiguous();
  args.inputs.tokens = {bf16_view(x, "x"), view_of<int32_t>(args.topk_idx, "topk_idx", at::kInt),
                        view_of<float>(topk_w, "topk_w", at::kFloat)};
  args.inputs.weights.gate = bf16_view(w_gate, "w_gate");
  args.inputs.weights.up = bf16_view(w_up, "w_up");
  args.inputs.weights.down = bf16_view(w_down, "w_down");
  if (has_shared) {
    args.inputs.weights.shared_gate = bf16_view(*w_shared_gate, "w_shared_gate");
    args.inputs.weights.shared_up = bf16_view(*w_shared_up, "w_shared_up");
    args.inputs.weights.shared_down = bf16_view(*w_shared_down, "w_shared_down");
  }
  return args;
}

// Runs `body`, turning mok::Error into the ValueError Python users expect.
template <class Body>
auto translating_errors(Body&& body) {
  try {
    return body();
  } catch (const Error& error) {
    TORCH_CHECK_VALUE(false, std::string(error.what()));
    throw;  // not reached: the check above throws
  }
}

Tensor forward_cpu(const Tensor& x, const Tensor& topk_idx, const Tensor& topk_w,
                   const Tensor& w_gate, const Tensor& w_up, const Tensor& w_down,
                   const OptionalTensor& w_shared_gate, const OptionalTensor& w_shared_up,
                   const OptionalTensor& w_shared_down) {
  return translating_errors([&] {
    LayerArgs args = layer_args(x, topk_idx, topk_w, w_gate, w_up, w_down, w_shared_gate,
                                w_shared_up, w_shared_down);
    Tensor y = at::empty({x.size(0), x.size(1)}, x.options());
    reference::RankOutputs outputs;
    outputs.y = mutable_view<bf16>(y);
    reference::forward(args.shape, {&args.inputs, 1}, {&outputs, 1});
    return y;
  });
}

using BackwardResult = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor>;

BackwardResult backward_cpu(const Tensor& dy, const Tensor& x, const Tensor& topk_idx,
                            const Tensor& topk_w, const Tensor& w_gate, const Tensor& w_up,
                            const Tensor& w_down, const OptionalTensor& w_shared_gate,
                            const OptionalTensor& w_shared_up, const OptionalTensor& w_shared_down) {
  return translating_errors([&] {
    LayerArgs args = layer_args(x, topk_idx, topk_w, w_gate, w_up, w_down, w_shared_gate,
                                w_shared_up, w_shared_down);
    args.inputs.dy = bf16_view(dy, "dy");
    const at::TensorOptions fp32 = x.options().dtype(at::kFloat);
    Tensor dx = at::empty_like(x);
    Tensor d_topk_w = at::empty({topk_w.size(0), topk_w.size(1)}, fp32);
    Tensor grad_gate = at::empty(w_gate.sizes(), fp32), grad_up = at::empty(w_up.sizes(), fp32);
    Tensor grad_down = at::empty(w_down.sizes(), fp32);
    const bool shared = args.shape.has_shared();
    Tensor grad_shared_gate = at::empty(shared ? w_shared_gate->sizes() : at::IntArrayRef{0}, fp32);
    Tensor grad_shared_up = at::empty(shared ? w_shared_up->sizes() : at::IntArrayRef{0}, fp32);
    Tensor grad_shared_down = at::empty(shared ? w_shared_down->sizes() : at::IntArrayRef{0}, fp32);

    reference::RankOutputs outputs;
    outputs.dx = mutable_view<bf16>(dx);
    outputs.d_topk_w = mutable_view<float>(d_topk_w);
    outputs.grads = {mutable_view<float>(grad_gate), mutable_view<float>(grad_up),
                     mutable_view<float>(grad_down)};
    if (shared) {
      outputs.grads.shared_gate = mutable_view<float>(grad_shared_gate);
      outputs.grads.shared_up = mutable_view<float>(grad_shared_up);
      outputs.grads.shared_down = mutable_view<float>(grad_shared_down);
    }
    reference::backward(args.shape, {&args.inputs, 1}, {&outputs, 1}, GradMode::kOverwrite);
    return BackwardResult{dx, d_topk_w, grad_gate, grad_up, grad_down,
                          grad_shared_gate, grad_shared_up, grad_shared_down};
  });
}

[[noreturn]] void no_gpu_layer(const char* op, const c10::Device& device) {
  TORCH_CHECK_NOT_IMPLEMENTED(false, detail::concat(op, ": the GPU layer is not in this build yet; tensors on ",
                                                     device.str(), " cannot run (CPU tensors use the CPU backend)"));
  throw;  // not reached
}

Tensor forward_cuda(const Tensor& x, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                    const Tensor&, const OptionalTensor&, const OptionalTensor&, const OptionalTensor&) {
  no_gpu_layer("mok::forward", x.device());
}

BackwardResult backward_cuda(const Tensor& dy, const Tensor&, const Tensor&, const Tensor&,
                             const Tensor&, const Tensor&, const Tensor&, const OptionalTensor&,
                             const OptionalTensor&, const OptionalTensor&) {
  no_gpu_layer("mok::backward", dy.device());
}

}  // namespace

TORCH_LIBRARY(mok, m) {
  m.def("forward(Tensor x, Tensor topk_idx, Tensor topk_w, Tensor w_gate, Tensor w_up, "
        "Tensor w_down, Tensor? w_shared_gate, Tensor? w_shared_up, Tensor? w_shared_down) -> Tensor");
  m.def("backward(Tensor dy, Tensor x, Tensor topk_idx, Tensor topk_w, Tensor w_gate, "
        "Tensor w_up, Tensor w_down, Tensor? w_shared_gate, Tensor? w_shared_up, "
        "Tensor? w_shared_down) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(mok, CPU, m) {
  m.impl("forward", &forward_cpu);
  m.impl("backward", &backward_cpu);
}

TORCH_LIBRARY_IMPL(mok, CUDA, m) {
  m.impl("forward", &forward_cuda);
  m.impl("backward", &backward_cuda);
}

}  // namespace mok::torch_ops
