// The GPU backward of one MoE layer in precision mode mxfp8 on one expert-parallel rank: the
// numerics mode of layer_forward_mxfp8.hpp on the bf16 engine, every operand the CPU reference
// quantizes (src/reference/quantized_engine.cpp, backward) quantized to mxfp8 and dequantized
// again into bf16, in recompute mode (the forward's inputs alone) or save mode (LayerForwardMxfp8
// kept the gate/up pre-activations: SavedContext; the same bits).
//
//   stage x, dy, topk_w; schedule     as bf16 (x and dy travel as bf16 rows: the wgrads' 32 x 1
//                                     blocks mix every rank's rows, so they need the values)
//   shared expert                     the routed steps below on this rank's own tokens (w = 1),
//                                     its dx in fp32 for the reduce
//   dispatch x, dy                    bf16 rows into expert_x, expert_dy
//   routed gate/up                    recompute mode: x's rows round-tripped 1 x 32 (the bytes of
//                                     the token's own rank's), bf16 GEMM, sums rounded to bf16
//   routed down dgrad                 dy's rows round-tripped 1 x 32; g = W_downᵀ dy, fp32, on the
//                                     dgrad copy of the weights (32 x 1 blocks of the forward's)
//   SwiGLU backward                   d_topk_w = <g, h> into the owner's window; d_a, d_b
//                                     round-tripped 1 x 32 along 2I and 32 x 1 down the rows, w·h
//                                     32 x 1 (kernels/megakernel/swiglu_mxfp8.cuh)
//   routed gate/up dgrad              dx rows (bf16) into expert_y
//   combine push
//   wgrads                            dy's and x's rows round-tripped 32 x 1 down each expert's
//                                     rows (blocks from the expert's first row); bf16 wgrad GEMMs,
//                                     each expert's rows in global token order
//   combine reduce, d_topk_w          as bf16
//
// The weights come from an MxWeightCache with the dgrad copy (LayerForwardMxfp8Options::
// dgrad_weights). Asynchronous on the caller's stream, no host synchronisation. Construction and
// destruction are collective (see CommWorkspace).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/megakernel/swiglu_mxfp8.cuh"
#include "mok/bf16.hpp"
#include "mok/layer.hpp"
#include "runtime/comm.hpp"
#include "runtime/layer_backward.hpp"
#include "runtime/mx_weights.hpp"
#include "runtime/side_stream.hpp"
#include "runtime/workspace.hpp"

namespace mok {

class LayerBackwardMxfp8 {
 public:
  // tokens_max: the most tokens any call passes on any rank. H, I and I_s multiples of 32.
  LayerBackwardMxfp8(const Communicator& comm, const LayerShape& shape, int64_t tokens_max,
                     const LayerBackwardOptions& options = {});
  ~LayerBackwardMxfp8();
  LayerBackwardMxfp8(const LayerBackwardMxfp8&) = delete;
  LayerBackwardMxfp8& operator=(const LayerBackwardMxfp8&) = delete;

  // As LayerBackwardFp8::backward, on the round-tripped weights (both copies, made for this rank's
  // experts of this layer's shape). phase_events: kNumBackwardPhases + 1 events (BackwardPhase;
  // the round trips count to the phase whose GEMM reads them). saved: save mode, the context
  // LayerForwardMxfp8 kept; null: recompute mode. Throws mok::Error before enqueueing anything
  // when the cache has no weights or no dgrad copy.
  void backward(const MxWeightCache& weights, const bf16* x, const int32_t* topk_idx,
                const float* topk_w, const bf16* dy, bf16* dx, float* d_topk_w,
                const DeviceLayerGradients& grads, int64_t num_tokens, cudaStream_t stream,
                const cudaEvent_t* phase_events = nullptr, const SavedContext* saved = nullptr);

  // Waits for `stream` and throws mok::Error naming rank, phase and cause of a device fault.
  void check(cudaStream_t stream) const { workspace_.check(stream); }
  // The order of its phases (and phase marks): BackwardPhase's, at every EP degree.
  const BackwardPhaseOrder& phase_order() const { return kBackwardPhaseOrder; }
  CommWorkspace& workspace() { return workspace_; }
  const LayerShape& shape() const { return shape_; }
  int64_t tokens_max() const { return tokens_max_; }
  // Device bytes: workspace and intermediates; the static one without a layer.
  int64_t buffer_bytes() const;
  static int64_t buffer_bytes(const LayerShape& shape, int num_ranks, int64_t tokens_max,
                              const LayerBackwardOptions& options = {});

 private:
  // The per-row operands of one group of experts (the routed ones, or the shared expert over this
  // rank's tokens).
  struct Operands {
    bf16* rows = nullptr;               // (rows, H): x's or dy's rows round-tripped, one at a time
    bf16* gate_up = nullptr;            // (rows, 2I) recomputed pre-activations
    float* grad_hidden = nullptr;       // (rows, I) fp32: g
    bf16* d_gate_up_rows = nullptr;     // (rows, 2I), 1 x 32
    bf16* d_gate_up_columns = nullptr;  // (rows, 2I), 32 x 1
    bf16* hidden_columns = nullptr;     // (rows, I): w·h, 32 x 1
  };
  static Operands alloc_operands(int64_t rows, int64_t hidden, int64_t inter);
  static void free_operands(Operands& operands);
  static int64_t operand_bytes(int64_t rows, int64_t hidden, int64_t inter);
  static megakernel::SwiGluBackwardMxRows swiglu_rows(const Operands& op, const bf16* gate_up,
                                                      bool saved_by_source, int inter,
                                                      const quantize::MxColumnGroups& groups);
  // The grid of the SwiGLU backward over `groups` of at most `rows` rows in all.
  dim3 swiglu_grid(int64_t rows, int groups) const;

  void run_shared_expert(const MxWeightCache& weights, const bf16* x, const bf16* dy,
                         const DeviceLayerGradients& grads, int tokens, cudaStream_t stream,
                         const gemm::LaunchOptions& gemm_options, const bf16* saved_gate_up);
  template <class Mark>
  void run_routed_experts(const MxWeightCache& weights, const DeviceLayerGradients& grads,
                          const bf16* saved_gate_up, cudaStream_t stream, const Mark& mark);

  LayerShape shape_;
  int64_t tokens_max_ = 0;
  LayerBackwardOptions options_;
  CommWorkspace workspace_;
  int num_sms_ = 0;
  SideStream side_;  // the dispatch, when it overlaps the shared expert
  Operands routed_, shared_;
  float* ones_ = nullptr;              // (T_max, k) 1.0f: the reduce's weights for dx
  float* shared_dx_ = nullptr;         // (T_max, H) fp32
  int32_t* shared_offsets_ = nullptr;  // (2): 0, T of the current call
};

}  // namespace mok
