// The CPU half of the bridge: the CPU backend (mok::reference) for one rank.
#include <utility>

#include "mok/error.hpp"
#include "mok/precision.hpp"
#include "mok/reference.hpp"
#include "mok/shape.hpp"
#include "mok/torch_bridge.hpp"

namespace mok::torch_bridge {

namespace {

LayerShape core_shape(const Shape& shape) {
  return {shape.hidden, shape.intermediate, shape.shared_intermediate, shape.num_experts,
          shape.top_k};
}

template <class T>
View<const T> view_of(const HostTensor& tensor) {
  return View<const T>(static_cast<const T*>(tensor.data), tensor.sizes);
}

template <class T>
View<T> mutable_view(void* data, std::vector<int64_t> sizes) {
  return View<T>(static_cast<T*>(data), std::move(sizes));
}

reference::RankInputs rank_inputs(const CpuLayerInputs& inputs, bool has_shared) {
  reference::RankInputs rank;
  rank.tokens = {view_of<bf16>(inputs.x), view_of<int32_t>(inputs.topk_idx),
                 view_of<float>(inputs.topk_w)};
  rank.weights.gate = view_of<bf16>(inputs.gate);
  rank.weights.up = view_of<bf16>(inputs.up);
  rank.weights.down = view_of<bf16>(inputs.down);
  if (has_shared) {
    rank.weights.shared_gate = view_of<bf16>(inputs.shared_gate);
    rank.weights.shared_up = view_of<bf16>(inputs.shared_up);
    rank.weights.shared_down = view_of<bf16>(inputs.shared_down);
  }
  if (inputs.dy.data != nullptr) rank.dy = view_of<bf16>(inputs.dy);
  return rank;
}

reference::Options options_of(const CpuLayerInputs& inputs) {
  reference::Options options;
  options.precision = parse_precision(inputs.precision);
  return options;
}

// Runs `body`, turning the core's mok::Error into the bridge's CoreError (same message).
template <class Body>
void translating_errors(Body&& body) {
  try {
    body();
  } catch (const Error& error) {
    throw CoreError(error.what());
  }
}

}  // namespace

int64_t min_ring_rows() { return kMinRingRows; }

void cpu_forward(const Shape& shape, const CpuLayerInputs& inputs, void* y) {
  translating_errors([&] {
    const LayerShape layer = core_shape(shape);
    const reference::RankInputs rank = rank_inputs(inputs, layer.has_shared());
    reference::RankOutputs outputs;
    outputs.y = mutable_view<bf16>(y, inputs.x.sizes);
    reference::forward(layer, {&rank, 1}, {&outputs, 1}, options_of(inputs));
  });
}

void cpu_backward(const Shape& shape, const CpuLayerInputs& inputs,
                  const CpuLayerGradients& grads) {
  translating_errors([&] {
    const LayerShape layer = core_shape(shape);
    const reference::RankInputs rank = rank_inputs(inputs, layer.has_shared());
    reference::RankOutputs outputs;
    outputs.dx = mutable_view<bf16>(grads.dx, inputs.x.sizes);
    outputs.d_topk_w = mutable_view<float>(grads.d_topk_w, inputs.topk_w.sizes);
    outputs.grads.gate = mutable_view<float>(grads.gate, inputs.gate.sizes);
    outputs.grads.up = mutable_view<float>(grads.up, inputs.up.sizes);
    outputs.grads.down = mutable_view<float>(grads.down, inputs.down.sizes);
    if (layer.has_shared()) {
      outputs.grads.shared_gate = mutable_view<float>(grads.shared_gate, inputs.shared_gate.sizes);
      outputs.grads.shared_up = mutable_view<float>(grads.shared_up, inputs.shared_up.sizes);
      outputs.grads.shared_down = mutable_view<float>(grads.shared_down, inputs.shared_down.sizes);
    }
    reference::backward(layer, {&rank, 1}, {&outputs, 1}, GradMode::kOverwrite, options_of(inputs));
  });
}

}  // namespace mok::torch_bridge

#if !defined(MOK_WITH_CUDA)
// A core built without CUDA: the GPU half says so.
namespace mok::torch_bridge {

namespace {
[[noreturn]] void no_gpu_layer() {
  throw CoreError(
      "mok was built without CUDA (no nvcc at build time): the GPU layer is unavailable");
}
}  // namespace

bool have_gpu_layer() { return false; }
bool have_nccl() { return false; }
std::vector<uint8_t> nccl_unique_id() { no_gpu_layer(); }
int64_t create_workspace(const WorkspaceSpec&) { no_gpu_layer(); }
void destroy_workspace(int64_t) { no_gpu_layer(); }
void forward(int64_t, const ForwardCall&) { no_gpu_layer(); }
int64_t saved_context_rows(int64_t, const ForwardCall&) { no_gpu_layer(); }
void backward(int64_t, const BackwardCall&) { no_gpu_layer(); }
void check(int64_t, int, void*) { no_gpu_layer(); }
void reset_after_error(int64_t, int) { no_gpu_layer(); }

}  // namespace mok::torch_bridge
#endif
