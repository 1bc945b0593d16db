// The GPU half of the bridge, internals shared by its two files: torch_bridge_gpu.cu (the
// workspace registry, bf16 and fp8) and torch_bridge_mxfp8.cu (mxfp8). A workspace's layer
// objects, the record of the weights each FP8 mode's weight cache was made from, and the helpers
// that turn a call's plain pointers into the layers' types. Host code only.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <memory>

#include "mok/torch_bridge.hpp"
#include "runtime/comm.hpp"
#include "runtime/layer_backward.hpp"
#include "runtime/layer_backward_fp8.hpp"
#include "runtime/layer_backward_mxfp8.hpp"
#include "runtime/layer_forward.hpp"
#include "runtime/layer_forward_fp8.hpp"
#include "runtime/layer_forward_mxfp8.hpp"

namespace mok::torch_bridge {

// The weights a weight cache was quantized from: the addresses and the version sum of the call
// that quantized them (the rule above ForwardCall in torch_bridge.hpp).
struct CachedWeights {
  DeviceWeights weights;
  int64_t version = -1;  // -1: none, or unknown (inference tensors): no call matches

  // Whether a call bringing `given` at `given_version` finds them in the cache as they are.
  bool holds(const DeviceWeights& given, int64_t given_version) const {
    return given_version >= 0 && given_version == version && given.gate_up == weights.gate_up &&
           given.down == weights.down && given.shared_gate_up == weights.shared_gate_up &&
           given.shared_down == weights.shared_down;
  }
};

struct Workspace {
  Shape shape;  // E global
  int device = 0;
  int rank = 0, num_ranks = 1;
  int64_t tokens_max = 0;
  bool automatic = false;
  bool low_memory_backward = false;  // WorkspaceSpec's: the bf16 backward in chunks
  ncclComm_t comm = nullptr;         // made here from the unique id; null for EP = 1
  Communicator communicator;         // over `comm`, or the single rank
  std::unique_ptr<LayerForward> layer;
  std::unique_ptr<LayerBackward> backward;  // made by the first bf16 backward call
  // Each FP8 mode's forward is made by the mode's first call; its weight cache serves the mode's
  // forward and backward (the rule above ForwardCall in torch_bridge.hpp). The backward's layout
  // of the weights (fp8: transposed; mxfp8: the dgrads' copy) is there once a backward of the mode
  // has run on the workspace (*_trains): forwards alone keep the forward's layout only. The torch
  // ops keep one set of weights alive per workspace, the last FP8 call's, so a call in one mode
  // forgets the other mode's record (*_cached): those weights may be gone and their addresses
  // reused.
  std::unique_ptr<LayerForwardFp8> fp8;
  bool fp8_trains = false;
  std::unique_ptr<LayerBackwardFp8> fp8_backward;  // made by the first fp8 backward call
  CachedWeights fp8_cached;
  std::unique_ptr<LayerForwardMxfp8> mxfp8;
  bool mxfp8_trains = false;
  std::unique_ptr<LayerBackwardMxfp8> mxfp8_backward;  // made by the first mxfp8 backward call
  CachedWeights mxfp8_cached;

  Workspace() = default;
  Workspace(const Workspace&) = delete;
  Workspace& operator=(const Workspace&) = delete;
  ~Workspace();  // (torch_bridge_gpu.cu)
};

inline LayerShape core_shape(const Shape& shape) {
  return {shape.hidden, shape.intermediate, shape.shared_intermediate, shape.num_experts,
          shape.top_k};
}

inline DeviceLayerWeights device_weights(const LayerForward& layer, const DeviceWeights& given) {
  // The element counts come from the layer's shape; the pointers are the caller's tensors.
  DeviceLayerWeights weights = layer.device_weights();
  weights.gate_up = const_cast<bf16*>(static_cast<const bf16*>(given.gate_up));
  weights.down = const_cast<bf16*>(static_cast<const bf16*>(given.down));
  weights.shared_gate_up = const_cast<bf16*>(static_cast<const bf16*>(given.shared_gate_up));
  weights.shared_down = const_cast<bf16*>(static_cast<const bf16*>(given.shared_down));
  return weights;
}

// The context of save mode (SavedContext) a call gives, or null (recompute mode). (const only in
// a backward call: the backward reads the context)
inline const SavedContext* saved_context(const void* gate_up, const void* shared_gate_up,
                                         SavedContext& storage) {
  if (gate_up == nullptr) return nullptr;
  storage = {static_cast<bf16*>(const_cast<void*>(gate_up)),
             static_cast<bf16*>(const_cast<void*>(shared_gate_up))};
  return &storage;
}

// The layer's weight gradients as the call asks for them.
inline DeviceLayerGradients device_gradients(const BackwardCall& call) {
  return {call.grad_gate_up, call.grad_down, call.grad_shared_gate_up, call.grad_shared_down,
          call.accumulate       ? gemm::WgradOutput::kAccumulateFp32
          : call.bf16_gradients ? gemm::WgradOutput::kBf16
                                : gemm::WgradOutput::kFp32};
}

inline LayerBackwardOptions backward_options(const Workspace& workspace) {
  LayerBackwardOptions options;
  if (workspace.layer->options().copy.num_ctas > 0) {
    options.copy.num_ctas = workspace.layer->options().copy.num_ctas;
  }
  return options;
}

// Runs a call of an FP8 mode; when it throws (after its weights may have been quantized into the
// cache), the cache's record is dropped, so that the next call quantizes again: the caller keeps
// the weights of the last call that returned alive, not those of one that threw.
template <class Body>
void forgetting_cache_on_error(CachedWeights& cached, Body&& body) {
  try {
    body();
  } catch (...) {
    cached = {};
    throw;
  }
}

// The mxfp8 forward and backward of a call on a workspace (torch_bridge_mxfp8.cu): fp8's path,
// with LayerForwardMxfp8 and LayerBackwardMxfp8 on the workspace's mxfp8 weight cache.
void forward_mxfp8(Workspace& workspace, const ForwardCall& call);
void backward_mxfp8(Workspace& workspace, const BackwardCall& call);

}  // namespace mok::torch_bridge
