// The GPU layer of one rank, for C++ users: the fused forward and the backward of one MoE layer
// on the caller's CUDA stream, no host synchronisation, bitwise reproducible. Device pointers on
// the layer's GPU; weights in the layouts the GEMM engine reads (gate/up interleaved in blocks of 8
// rows: gemm::interleave_gate_up). The backward either recomputes the gate/up pre-activations
// from x (recompute mode) or reads them from a context the forward saved (save mode); the same
// bits either way.
//
//   mok::GpuLayer layer(/*device=*/0, shape, tokens_max);       // EP = 1; owns its weights
//   (fill layer.weights() on the device)
//   layer.forward(x, topk_idx, topk_w, y, tokens, stream);
//   layer.backward(x, topk_idx, topk_w, dy, dx, d_topk_w, grads, tokens, stream);
//   layer.check(stream);                                         // syncs; throws on a device fault
//
// Save mode: give the forward a GpuSavedContext of saved_context_elements(tokens) bf16 values
// (and shared_saved_context_elements(tokens)), keep it until the backward of the same call.
#pragma once

#include <cstdint>
#include <memory>

#include "mok/bf16.hpp"
#include "mok/gemm.hpp"
#include "mok/shape.hpp"

namespace mok {

struct GpuLayerOptions {
  // Rows of the ring that holds the rows this rank receives: 0 = every row (one round); fewer
  // (at least kMinRingRows, mok/shape.hpp) bound the memory: rounds, any routing still runs.
  int64_t ring_rows = 0;
  int minibatch_rows = 0;  // the fused kernel's routed rows per minibatch; 0 = default
};

// The layer's device weights (bf16). Shared ones null and 0 elements without a shared expert.
struct GpuLayerWeights {
  bf16* gate_up = nullptr;         // (E_l, 2I, H), gate/up interleaved in blocks of 8 rows
  bf16* down = nullptr;            // (E_l, H, I)
  bf16* shared_gate_up = nullptr;  // (2I_s, H), interleaved alike
  bf16* shared_down = nullptr;     // (H, I_s)
  int64_t gate_up_elements = 0, down_elements = 0;
  int64_t shared_gate_up_elements = 0, shared_down_elements = 0;
};

// Weight gradients in the weights' layouts: fresh fp32, fresh bf16, or added into fp32 buffers.
struct GpuLayerGradients {
  void* gate_up = nullptr;
  void* down = nullptr;
  void* shared_gate_up = nullptr;  // null without a shared expert
  void* shared_down = nullptr;
  gemm::WgradOutput output = gemm::WgradOutput::kFp32;
};

// What a forward keeps for its backward in save mode: the gate/up pre-activations (bf16), in
// buffers the caller owns. Shared one null without a shared expert.
struct GpuSavedContext {
  bf16* gate_up = nullptr;         // saved_context_elements(T) values
  bf16* shared_gate_up = nullptr;  // shared_saved_context_elements(T) values
};

class GpuLayer {
 public:
  // EP = 1 on CUDA device `device`, for calls of at most `tokens_max` tokens; allocates the
  // weights (weights()) and every buffer. Throws mok::Error naming a bad argument.
  GpuLayer(int device, const LayerShape& shape, int64_t tokens_max,
           const GpuLayerOptions& options = {});
  ~GpuLayer();
  GpuLayer(const GpuLayer&) = delete;
  GpuLayer& operator=(const GpuLayer&) = delete;

  const GpuLayerWeights& weights() const;

  // x (T, H) bf16, topk_idx (T, k) int32 (-1 = unused slot), topk_w (T, k) fp32, y (T, H) bf16;
  // stream: a cudaStream_t. save: keep the context for a save-mode backward, or null.
  void forward(const bf16* x, const int32_t* topk_idx, const float* topk_w, bf16* y,
               int64_t num_tokens, void* stream, const GpuSavedContext* save = nullptr);
  // The same routing as the forward; dy, dx (T, H) bf16, d_topk_w (T, k) fp32. saved: the context
  // that forward kept (save mode), or null (recompute mode).
  void backward(const bf16* x, const int32_t* topk_idx, const float* topk_w, const bf16* dy,
                bf16* dx, float* d_topk_w, const GpuLayerGradients& grads, int64_t num_tokens,
                void* stream, const GpuSavedContext* saved = nullptr);

  // bf16 values of a GpuSavedContext for a call of num_tokens tokens.
  int64_t saved_context_elements(int64_t num_tokens) const;
  int64_t shared_saved_context_elements(int64_t num_tokens) const;

  // Waits for `stream`; throws mok::Error naming rank, phase and cause of a device fault (an
  // expert id out of range or repeated in a row, a peer that never arrived).
  void check(void* stream) const;
  // After a fault: clears the error records, flags and epochs of both passes.
  void reset_after_error();

  // Device bytes besides the weights: the forward's and the backward's workspaces and buffers.
  int64_t forward_buffer_bytes() const;
  int64_t backward_buffer_bytes() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace mok
