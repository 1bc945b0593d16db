// The CUDA kernels of mok::forward and mok::backward: the GPU layer forward (LayerForward) and
// backward (LayerBackward), or in an FP8 mode (fp8: LayerForwardFp8 and LayerBackwardFp8; mxfp8:
// LayerForwardMxfp8 and LayerBackwardMxfp8), on torch's current CUDA stream, with the caller's
// tensors as weights (no copy) and no host synchronisation. Also the device-fault check and reset
// ops, which need the current stream.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include "mok/torch_bridge.hpp"
#include "torch_args.hpp"

namespace mok::torch_ops {

namespace {

namespace bridge = ::mok::torch_bridge;

const void* optional_data(const OptionalTensor& tensor) {
  return tensor.has_value() && tensor->defined() ? tensor->data_ptr() : nullptr;
}

// The caller's tensors as the layer's device weights (no copy).
bridge::DeviceWeights device_weights(const Tensor& w_gate_up, const Tensor& w_down,
                                     const OptionalTensor& w_shared_gate_up,
                                     const OptionalTensor& w_shared_down) {
  return {w_gate_up.data_ptr(), w_down.data_ptr(), optional_data(w_shared_gate_up),
          optional_data(w_shared_down)};
}

// int64 ids are narrowed on the device (no host read of their range); the layer's schedule
// checks every id there and check() reports one out of range.
Tensor int32_ids(const Tensor& topk_idx) {
  return topk_idx.scalar_type() == at::kInt ? topk_idx : topk_idx.to(at::kInt);
}

// The FP8 modes read the workspace's weight cache of their mode (see fp8_weights_in_cache).
bool quantized(c10::string_view precision) { return precision != "bf16"; }

// An FP8 mode's weight cache (one per workspace and mode, read by the mode's forward and backward
// alike) is quantized from the weights of the workspace's last call in that mode, forward or
// backward, and made anew when their addresses or their version sum change (the rule above
// ForwardCall in torch_bridge.hpp). The addresses alone would not do: a weight made anew per call
// (ExpertWeights' fused gate/up) may land where the last one was. So the tensors of the last call
// stay referenced here until the next FP8 call on that workspace (in either mode: the bridge
// forgets the other mode's weights then): while they live no other tensor takes their memory, and
// the version counters (which only grow) see every in-place change. Inference tensors keep no
// version: with one among the weights the cache is made anew on every call (-1). A backward gets
// the forward's weights (autograd's saved tensors: the same tensors and versions, so the forward's
// cache as it is), or, changed in place since, quantizes them again.
std::mutex fp8_weights_mutex;
// Keyed as the bridge keys its workspaces: the handle, and for the automatic ones (handle 0) the
// device and the whole shape, so that two layers never share an entry.
using Fp8CacheKey = std::tuple<int64_t, int, int64_t, int64_t, int64_t, int64_t, int64_t>;
std::map<Fp8CacheKey, std::vector<Tensor>> fp8_weights_in_cache;

int64_t weights_version(const std::vector<Tensor>& weights) {
  int64_t version = 0;
  for (const Tensor& weight : weights) {
    if (weight.is_inference()) return -1;
    version += static_cast<int64_t>(weight._version());
  }
  return version;
}

// The weights of an fp8 call, to reference in fp8_weights_in_cache.
std::vector<Tensor> fp8_weight_tensors(const Tensor& w_gate_up, const Tensor& w_down,
                                       const OptionalTensor& w_shared_gate_up,
                                       const OptionalTensor& w_shared_down) {
  std::vector<Tensor> weights{w_gate_up, w_down};
  for (const OptionalTensor* shared : {&w_shared_gate_up, &w_shared_down}) {
    if (shared->has_value() && (*shared)->defined()) weights.push_back(**shared);
  }
  return weights;
}

// After an fp8 call returned: its weights are the cache's (see fp8_weights_in_cache).
void remember_fp8_weights(int64_t workspace, int device, const bridge::Shape& shape,
                          std::vector<Tensor> weights) {
  const std::lock_guard<std::mutex> lock(fp8_weights_mutex);
  const Fp8CacheKey key{
      workspace,         device,     shape.hidden, shape.intermediate, shape.shared_intermediate,
      shape.num_experts, shape.top_k};
  fp8_weights_in_cache[key] = std::move(weights);
}

using SaveResult = std::tuple<Tensor, Tensor, Tensor>;

// The forward; save: also the context a save-mode backward reads (y, saved gate/up pre-activations
// (rows, 2I), the shared expert's (T, 2I_s) or (0,)), in bf16 and fp8 alike (fp8: the FP8 gate/up
// GEMM's sums rounded to bf16, in its weight cache's column order); otherwise those two are empty.
SaveResult run_forward(const Tensor& x, const Tensor& topk_idx, const Tensor& topk_w,
                       const Tensor& w_gate_up, const Tensor& w_down,
                       const OptionalTensor& w_shared_gate_up, const OptionalTensor& w_shared_down,
                       int64_t workspace, c10::string_view precision, bool save) {
  return core_errors_as_value_errors([&] {
    const bool fp8 = quantized(precision);  // (the core checks the name)
    const LayerCall layer =
        read_layer_call(x, topk_idx, topk_w, w_gate_up, w_down, w_shared_gate_up, w_shared_down);
    const c10::cuda::CUDAGuard device_guard(x.device());
    const Tensor topk_idx32 = int32_ids(topk_idx);
    Tensor y = at::empty({x.size(0), x.size(1)}, x.options());
    Tensor saved_gate_up = at::empty({0}, x.options());
    Tensor saved_shared_gate_up = at::empty({0}, x.options());

    bridge::ForwardCall call;
    call.local_shape = layer.shape;
    call.weights = device_weights(w_gate_up, w_down, w_shared_gate_up, w_shared_down);
    call.x = x.data_ptr();
    call.topk_idx = topk_idx32.data_ptr<int32_t>();
    call.topk_w = topk_w.data_ptr<float>();
    call.y = y.data_ptr();
    call.num_tokens = x.size(0);
    call.device = x.device().index();
    call.stream = c10::cuda::getCurrentCUDAStream(x.device().index()).stream();
    call.precision = std::string(precision.data(), precision.size());
    std::vector<Tensor> fp8_weights;
    if (fp8) {
      fp8_weights = fp8_weight_tensors(w_gate_up, w_down, w_shared_gate_up, w_shared_down);
      call.weights_version = weights_version(fp8_weights);
    }
    if (save) {
      const int64_t rows = bridge::saved_context_rows(workspace, call);
      saved_gate_up = at::empty({rows, 2 * layer.shape.intermediate}, x.options());
      call.saved_gate_up = saved_gate_up.data_ptr();
      if (layer.has_shared) {
        saved_shared_gate_up =
            at::empty({x.size(0), 2 * layer.shape.shared_intermediate}, x.options());
        call.saved_shared_gate_up = saved_shared_gate_up.data_ptr();
      }
    }
    bridge::forward(workspace, call);
    if (fp8) remember_fp8_weights(workspace, call.device, layer.shape, std::move(fp8_weights));
    return SaveResult{y, saved_gate_up, saved_shared_gate_up};
  });
}

Tensor forward_cuda(const Tensor& x, const Tensor& topk_idx, const Tensor& topk_w,
                    const Tensor& w_gate_up, const Tensor& w_down,
                    const OptionalTensor& w_shared_gate_up, const OptionalTensor& w_shared_down,
                    int64_t workspace, c10::string_view precision) {
  return std::get<0>(run_forward(x, topk_idx, topk_w, w_gate_up, w_down, w_shared_gate_up,
                                 w_shared_down, workspace, precision, /*save=*/false));
}

SaveResult forward_save_cuda(const Tensor& x, const Tensor& topk_idx, const Tensor& topk_w,
                             const Tensor& w_gate_up, const Tensor& w_down,
                             const OptionalTensor& w_shared_gate_up,
                             const OptionalTensor& w_shared_down, int64_t workspace,
                             c10::string_view precision) {
  return run_forward(x, topk_idx, topk_w, w_gate_up, w_down, w_shared_gate_up, w_shared_down,
                     workspace, precision, /*save=*/true);
}

// A saved context's tensor, checked against what this call's forward would have made; null when
// not given (recompute mode).
const void* saved_data(const OptionalTensor& saved, const char* name, const Tensor& x,
                       std::vector<int64_t> sizes) {
  if (!saved.has_value() || !saved->defined() || saved->numel() == 0) return nullptr;
  check_tensor(*saved, name, at::kBFloat16, x.device());
  MOK_TORCH_CHECK(saved->sizes().equals(sizes), name, ": shape ", shape_text(saved->sizes()),
                  ", the forward of this call saves ", shape_text(at::IntArrayRef(sizes)));
  return saved->data_ptr();
}

using BackwardResult = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor>;

// mok's GPU backward: fresh weight gradients in the weights' layouts, fp32 or (bf16_grads) bf16;
// save mode with a forward_save context of the same precision, else recompute mode. fp8: on the
// workspace's fp8 weight cache, quantized anew from these weights where they are not the cache's.
BackwardResult backward_cuda(const Tensor& dy, const Tensor& x, const Tensor& topk_idx,
                             const Tensor& topk_w, const Tensor& w_gate_up, const Tensor& w_down,
                             const OptionalTensor& w_shared_gate_up,
                             const OptionalTensor& w_shared_down, int64_t workspace,
                             bool bf16_grads, const OptionalTensor& saved_gate_up,
                             const OptionalTensor& saved_shared_gate_up,
                             c10::string_view precision) {
  return core_errors_as_value_errors([&] {
    const bool fp8 = quantized(precision);  // (the core checks the name)
    const LayerCall layer =
        read_layer_call(x, topk_idx, topk_w, w_gate_up, w_down, w_shared_gate_up, w_shared_down);
    check_tensor(dy, "dy", at::kBFloat16, x.device());
    check_sizes(dy, "dy", {x.size(0), x.size(1)}, "(T, H)");
    const c10::cuda::CUDAGuard device_guard(x.device());
    const Tensor topk_idx32 = int32_ids(topk_idx);
    const at::TensorOptions fp32 = x.options().dtype(at::kFloat);
    const at::TensorOptions grad_options = bf16_grads ? x.options() : fp32;
    Tensor dx = at::empty_like(x);
    Tensor d_topk_w = at::empty({topk_w.size(0), topk_w.size(1)}, fp32);
    Tensor grad_gate_up = at::empty(w_gate_up.sizes(), grad_options);
    Tensor grad_down = at::empty(w_down.sizes(), grad_options);
    const bool shared = optional_data(w_shared_gate_up) != nullptr;
    Tensor grad_shared_gate_up =
        shared ? at::empty(w_shared_gate_up->sizes(), grad_options) : at::empty({0}, grad_options);
    Tensor grad_shared_down =
        shared ? at::empty(w_shared_down->sizes(), grad_options) : at::empty({0}, grad_options);

    bridge::BackwardCall call;
    call.local_shape = layer.shape;
    call.weights = device_weights(w_gate_up, w_down, w_shared_gate_up, w_shared_down);
    call.x = x.data_ptr();
    call.topk_idx = topk_idx32.data_ptr<int32_t>();
    call.topk_w = topk_w.data_ptr<float>();
    call.dy = dy.data_ptr();
    call.dx = dx.data_ptr();
    call.d_topk_w = d_topk_w.data_ptr<float>();
    call.grad_gate_up = grad_gate_up.data_ptr();
    call.grad_down = grad_down.data_ptr();
    call.grad_shared_gate_up = shared ? grad_shared_gate_up.data_ptr() : nullptr;
    call.grad_shared_down = shared ? grad_shared_down.data_ptr() : nullptr;
    call.bf16_gradients = bf16_grads;
    call.num_tokens = x.size(0);
    call.device = x.device().index();
    call.stream = c10::cuda::getCurrentCUDAStream(x.device().index()).stream();
    call.precision = std::string(precision.data(), precision.size());
    std::vector<Tensor> fp8_weights;
    if (fp8) {
      fp8_weights = fp8_weight_tensors(w_gate_up, w_down, w_shared_gate_up, w_shared_down);
      call.weights_version = weights_version(fp8_weights);
    }
    bridge::ForwardCall forward_call;  // (what its forward saved: the context's rows)
    forward_call.local_shape = layer.shape;
    forward_call.num_tokens = x.size(0);
    call.saved_gate_up = saved_data(
        saved_gate_up, "saved_gate_up", x,
        {bridge::saved_context_rows(workspace, forward_call), 2 * layer.shape.intermediate});
    if (call.saved_gate_up != nullptr && shared) {
      call.saved_shared_gate_up = saved_data(saved_shared_gate_up, "saved_shared_gate_up", x,
                                             {x.size(0), 2 * layer.shape.shared_intermediate});
      MOK_TORCH_CHECK(call.saved_shared_gate_up != nullptr || x.size(0) == 0,
                      "saved_shared_gate_up: missing beside saved_gate_up (the layer has a shared "
                      "expert)");
    }
    bridge::backward(workspace, call);
    if (fp8) remember_fp8_weights(workspace, call.device, layer.shape, std::move(fp8_weights));
    return BackwardResult{
        dx, d_topk_w, grad_gate_up, grad_down, grad_shared_gate_up, grad_shared_down};
  });
}

c10::DeviceIndex device_index(int64_t device) {
  MOK_TORCH_CHECK(device >= 0 && device < c10::cuda::device_count(), "device: cuda:", device,
                  " out of range: ", static_cast<int64_t>(c10::cuda::device_count()),
                  " CUDA devices visible");
  return static_cast<c10::DeviceIndex>(device);
}

}  // namespace

void forget_fp8_weights(int64_t workspace) {
  if (workspace == 0) return;  // (the automatic workspaces live as long as the process)
  const std::lock_guard<std::mutex> lock(fp8_weights_mutex);
  std::erase_if(fp8_weights_in_cache,
                [&](const auto& entry) { return std::get<0>(entry.first) == workspace; });
}

void check_op(int64_t workspace, int64_t device) {
  const c10::DeviceIndex index = device_index(device);
  const c10::cuda::CUDAGuard device_guard(index);
  void* stream = c10::cuda::getCurrentCUDAStream(index).stream();
  core_errors_as_runtime_errors([&] { bridge::check(workspace, static_cast<int>(index), stream); });
}

void reset_after_error_op(int64_t workspace, int64_t device) {
  const c10::DeviceIndex index = device_index(device);
  const c10::cuda::CUDAGuard device_guard(index);
  core_errors_as_runtime_errors(
      [&] { bridge::reset_after_error(workspace, static_cast<int>(index)); });
}

TORCH_LIBRARY_IMPL(mok, CUDA, m) {
  m.impl("forward", &forward_cuda);
  m.impl("forward_save", &forward_save_cuda);
  m.impl("backward", &backward_cuda);
}

}  // namespace mok::torch_ops
