// The bridge's mxfp8 calls on a GPU workspace (gpu_workspace.hpp): LayerForwardMxfp8 and
// LayerBackwardMxfp8, made on first use, on the workspace's mxfp8 weight cache, which the forward
// and the backward both read and which follows the weights exactly as fp8's does (the rule above
// ForwardCall in torch_bridge.hpp). Its saved context is the bf16 layer's (SavedContext). Host
// code only.
#include <cuda_runtime.h>

#include <memory>

#include "bridge/gpu_workspace.hpp"
#include "mok/torch_bridge.hpp"

namespace mok::torch_bridge {

namespace {

// The mxfp8 forward of a workspace, made on first use, and made again with the dgrads' copy of
// the weights in its cache by the workspace's first mxfp8 backward (the copy then stays); and that
// cache holding `given`: round-tripped anew from them unless it was made from the same addresses
// at the same known version.
LayerForwardMxfp8& mxfp8_layer_with_weights(Workspace& workspace, const DeviceWeights& given,
                                            int64_t weights_version, cudaStream_t stream) {
  workspace.fp8_cached = {};  // (the torch ops now keep this call's weights alive, not those)
  if (workspace.mxfp8 != nullptr && workspace.mxfp8_trains &&
      !workspace.mxfp8->weight_cache().has_dgrad()) {
    // NOTE: collective, as every rank's first backward is; cudaFree waits for the last forward.
    workspace.mxfp8.reset();
    workspace.mxfp8_cached = {};
  }
  if (workspace.mxfp8 == nullptr) {
    LayerForwardMxfp8Options options;
    options.layer.copy = workspace.layer->options().copy;
    options.dgrad_weights = workspace.mxfp8_trains;  // one cache for forward and backward
    workspace.mxfp8 = std::make_unique<LayerForwardMxfp8>(
        workspace.communicator, core_shape(workspace.shape), workspace.tokens_max, options);
  }
  if (!workspace.mxfp8->has_weights() || !workspace.mxfp8_cached.holds(given, weights_version)) {
    workspace.mxfp8->quantize_weights(device_weights(*workspace.layer, given), stream);
    workspace.mxfp8_cached = {given, weights_version};
  }
  return *workspace.mxfp8;
}

}  // namespace

void forward_mxfp8(Workspace& workspace, const ForwardCall& call) {
  const auto stream = static_cast<cudaStream_t>(call.stream);
  LayerForwardMxfp8& layer =
      mxfp8_layer_with_weights(workspace, call.weights, call.weights_version, stream);
  SavedContext save;
  layer.forward(static_cast<const bf16*>(call.x), call.topk_idx, call.topk_w,
                static_cast<bf16*>(call.y), call.num_tokens, stream, nullptr,
                saved_context(call.saved_gate_up, call.saved_shared_gate_up, save));
}

// Save mode with the call's context, else recompute mode; the weight cache made to hold the
// call's weights first where it does not.
void backward_mxfp8(Workspace& workspace, const BackwardCall& call) {
  const auto stream = static_cast<cudaStream_t>(call.stream);
  workspace.mxfp8_trains = true;
  const LayerForwardMxfp8& forward =
      mxfp8_layer_with_weights(workspace, call.weights, call.weights_version, stream);
  if (workspace.mxfp8_backward == nullptr) {
    workspace.mxfp8_backward =
        std::make_unique<LayerBackwardMxfp8>(workspace.communicator, core_shape(workspace.shape),
                                             workspace.tokens_max, backward_options(workspace));
  }
  SavedContext saved;
  workspace.mxfp8_backward->backward(
      forward.weight_cache(), static_cast<const bf16*>(call.x), call.topk_idx, call.topk_w,
      static_cast<const bf16*>(call.dy), static_cast<bf16*>(call.dx), call.d_topk_w,
      device_gradients(call), call.num_tokens, stream, nullptr,
      saved_context(call.saved_gate_up, call.saved_shared_gate_up, saved));
}

}  // namespace mok::torch_bridge
