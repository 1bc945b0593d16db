// mok::GpuLayer (mok/gpu_layer.hpp): LayerForward and LayerBackward of one rank on one
// communicator, behind the public header.
#include "mok/gpu_layer.hpp"

#include <cuda_runtime.h>

#include "mok/cuda_check.hpp"
#include "runtime/comm.hpp"
#include "runtime/layer_backward.hpp"
#include "runtime/layer_forward.hpp"

namespace mok {
namespace {

LayerForwardOptions forward_options(const GpuLayerOptions& options) {
  LayerForwardOptions forward;
  forward.fused.ring_rows = options.ring_rows;
  forward.fused.minibatch_rows = options.minibatch_rows;
  return forward;
}

cudaStream_t as_stream(void* stream) { return static_cast<cudaStream_t>(stream); }

SavedContext as_saved(const GpuSavedContext& context) {
  return {context.gate_up, context.shared_gate_up};
}

}  // namespace

struct GpuLayer::Impl {
  Impl(const Communicator& comm, const LayerShape& shape, int64_t tokens_max,
       const GpuLayerOptions& options)
      : communicator(comm),
        forward(comm, shape, tokens_max, forward_options(options)),
        backward(comm, shape, tokens_max) {
    const DeviceLayerWeights& device = forward.device_weights();
    weights = {device.gate_up,
               device.down,
               device.shared_gate_up,
               device.shared_down,
               device.gate_up_elements,
               device.down_elements,
               device.shared_gate_up_elements,
               device.shared_down_elements};
  }

  Communicator communicator;
  LayerForward forward;
  LayerBackward backward;
  GpuLayerWeights weights;
};

GpuLayer::GpuLayer(int device, const LayerShape& shape, int64_t tokens_max,
                   const GpuLayerOptions& options) {
  MOK_CUDA_CHECK(cudaSetDevice(device));
  impl_ = std::make_unique<Impl>(Communicator::single(device), shape, tokens_max, options);
}

GpuLayer::~GpuLayer() = default;

const GpuLayerWeights& GpuLayer::weights() const { return impl_->weights; }

void GpuLayer::forward(const bf16* x, const int32_t* topk_idx, const float* topk_w, bf16* y,
                       int64_t num_tokens, void* stream, const GpuSavedContext* save) {
  const SavedContext context = save != nullptr ? as_saved(*save) : SavedContext{};
  impl_->forward.forward(x, topk_idx, topk_w, y, num_tokens, as_stream(stream), nullptr,
                         save != nullptr ? &context : nullptr);
}

void GpuLayer::backward(const bf16* x, const int32_t* topk_idx, const float* topk_w, const bf16* dy,
                        bf16* dx, float* d_topk_w, const GpuLayerGradients& grads,
                        int64_t num_tokens, void* stream, const GpuSavedContext* saved) {
  const DeviceLayerGradients device_grads{grads.gate_up, grads.down, grads.shared_gate_up,
                                          grads.shared_down, grads.output};
  const SavedContext context = saved != nullptr ? as_saved(*saved) : SavedContext{};
  impl_->backward.backward(impl_->forward.device_weights(), x, topk_idx, topk_w, dy, dx, d_topk_w,
                           device_grads, num_tokens, as_stream(stream), nullptr,
                           saved != nullptr ? &context : nullptr);
}

int64_t GpuLayer::saved_context_elements(int64_t num_tokens) const {
  const LayerShape& shape = impl_->forward.shape();
  return saved_context_rows(impl_->forward.workspace().num_ranks(), impl_->forward.tokens_max(),
                            shape.top_k, num_tokens) *
         2 * shape.intermediate;
}

int64_t GpuLayer::shared_saved_context_elements(int64_t num_tokens) const {
  return num_tokens * 2 * impl_->forward.shape().shared_intermediate;
}

void GpuLayer::check(void* stream) const {
  impl_->forward.check(as_stream(stream));
  impl_->backward.check(as_stream(stream));
}

void GpuLayer::reset_after_error() {
  impl_->forward.workspace().reset_after_error();
  impl_->backward.workspace().reset_after_error();
}

int64_t GpuLayer::forward_buffer_bytes() const { return impl_->forward.buffer_bytes(); }
int64_t GpuLayer::backward_buffer_bytes() const { return impl_->backward.buffer_bytes(); }

}  // namespace mok
