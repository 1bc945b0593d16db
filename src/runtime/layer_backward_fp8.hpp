// The GPU backward of one MoE layer in precision mode fp8 (DESIGN.md §3, the DeepSeek-V3 recipe) on
// one expert-parallel rank, composed from the tested engines as the bf16 backward is
// (layer_backward.hpp), at the CPU reference's rounding points (src/reference/quantized_engine.cpp,
// backward), in recompute mode (the forward's inputs alone; the gate/up pre-activations are
// computed again from the FP8 operands) or save mode (LayerForwardFp8 kept them: SavedContext; the
// same bits).
//
//   stage x, dy, topk_w; schedule     as bf16
//   shared expert                     the routed steps below on this rank's own tokens (w = 1),
//                                     its dx in fp32 for the reduce
//   dispatch x, dy                    bf16 rows into expert_x, expert_dy; then each quantized 1 x
//                                     128 along H (a row gets the bytes its token's own rank's
//                                     quantization gives). One rank alone: no dispatch; the expert
//                                     rows gathered from x and dy straight into their 1 x 128 rows
//                                     and the wgrads' 128 x 1 operands
//                                     (kernels/megakernel/expert_rows_fp8.cuh)
//   routed gate/up                    FP8 GEMM, fp32 sums rounded to bf16 (a, b); save mode: read
//                                     from the context (nor are the x rows quantized 1 x 128)
//   routed down dgrad                 g = W_downᵀ dy: FP8 GEMM on the transposed weight, fp32
//   SwiGLU backward                   d_topk_w = <g, h> into the owner's window; d_a, d_b
//                                     quantized 1 x 128 along 2I and 128 x 1 down the rows, w·h
//                                     128 x 1, from fp32 values that stay in shared memory
//                                     (kernels/megakernel/swiglu_backward_fp8.cuh)
//   routed gate/up dgrad              dx rows (bf16) into expert_y
//   combine push
//   wgrads                            x and dy quantized 128 x 1 down each expert's rows (blocks
//                                     from the expert's first row, the rows past its count as
//                                     zeros); FP8 wgrad GEMMs, each expert's rows in global token
//                                     order
//   combine reduce, d_topk_w          as bf16
//
// The weights come quantized 128 x 128 in a cache with both layouts (fp8_weights.hpp: the forward
// layout for the recompute, the transposed one for the dgrads), made once per change of them: the
// training step's LayerForwardFp8 holds one (LayerForwardFp8Options::transposed_weights).
// Asynchronous on the caller's stream, no host synchronisation (CUDA-graph capturable).
// Construction and destruction are collective (see CommWorkspace).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/megakernel/swiglu_backward_fp8.cuh"
#include "mok/bf16.hpp"
#include "mok/gemm_fp8.hpp"
#include "mok/layer.hpp"
#include "runtime/comm.hpp"
#include "runtime/fp8_weights.hpp"
#include "runtime/layer_backward.hpp"
#include "runtime/side_stream.hpp"
#include "runtime/workspace.hpp"

namespace mok {

struct LayerBackwardFp8Options {
  LayerBackwardOptions layer;  // copies, GEMM grid, workspace, the dispatch's placement
  // The forward and dgrad FP8 GEMMs' clusters and ring (same bits whichever); single CTAs, as
  // the fp8 forward (LayerForwardFp8Options::pipeline).
  gemm::Fp8Pipeline pipeline{/*cluster=*/1, /*stages=*/0};
};

class LayerBackwardFp8 {
 public:
  // tokens_max: the most tokens any call passes on any rank. H, I and I_s multiples of 128.
  LayerBackwardFp8(const Communicator& comm, const LayerShape& shape, int64_t tokens_max,
                   const LayerBackwardFp8Options& options = {});
  ~LayerBackwardFp8();
  LayerBackwardFp8(const LayerBackwardFp8&) = delete;
  LayerBackwardFp8& operator=(const LayerBackwardFp8&) = delete;

  // As LayerBackward::backward in recompute mode, on the cached weights (both layouts, made for
  // this rank's experts of this layer's shape): x, dy, dx (T, H) bf16; topk_idx (T, k) int32;
  // topk_w, d_topk_w (T, k) fp32; grads in DeviceLayerGradients' layouts (any of its outputs).
  // phase_events: kNumBackwardPhases + 1 events (BackwardPhase; the quantizations of the dispatched
  // rows count to kDispatch, those of the wgrads' operands to their wgrad). saved: save mode, the
  // context LayerForwardFp8 kept in the forward of these inputs (SavedContext); null: recompute
  // mode. Throws mok::Error before enqueueing anything when the cache has no weights or no
  // transposed layout.
  void backward(const Fp8WeightCache& weights, const bf16* x, const int32_t* topk_idx,
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
  // Device bytes: workspace and intermediates; the static one without a layer (what one of these
  // arguments would hold).
  int64_t buffer_bytes() const;
  static int64_t buffer_bytes(const LayerShape& shape, int num_ranks, int64_t tokens_max,
                              const LayerBackwardOptions& options = {});

 private:
  // The per-row operands of one group of experts (the routed ones, or the shared expert over this
  // rank's tokens): rows (rows, ...) and the wgrads' transposed copies (..., padded_rows).
  struct Operands {
    Fp8Operand x, dy;                             // (rows, H), 1 x 128
    bf16* gate_up = nullptr;                      // (rows, 2I) bf16, 128-interleaved
    float* grad_hidden = nullptr;                 // (rows, I) fp32
    Fp8Operand d_gate_up_rows;                    // (rows, 2I), 1 x 128
    Fp8Operand x_t, dy_t, d_gate_up_t, hidden_t;  // (H | H | 2I | I, padded_rows), 128 x 1
  };
  // The SwiGLU backward's view of a group's rows, their pre-activations in gate_up: op.gate_up
  // recomputed, or a saved context's (saved_by_source: the routed rows' by their source slot);
  // its 128 x 1 outputs over padded_rows in `groups`' blocks.
  static megakernel::SwiGluBackwardFp8Rows swiglu_rows(const Operands& op, const bf16* gate_up,
                                                       bool saved_by_source, int inter,
                                                       int64_t padded_rows,
                                                       quantize::ExpertRows groups) {
    return {reinterpret_cast<const __nv_bfloat16*>(gate_up),
            saved_by_source,
            op.grad_hidden,
            op.d_gate_up_rows.data,
            op.d_gate_up_rows.scales,
            op.d_gate_up_t.data,
            op.d_gate_up_t.scales,
            op.hidden_t.data,
            op.hidden_t.scales,
            padded_rows,
            inter,
            groups};
  }
  static Operands alloc_operands(int64_t rows, int64_t padded_rows, int64_t hidden, int64_t inter);
  static void free_operands(Operands& operands);
  static int64_t operand_bytes(int64_t rows, int64_t padded_rows, int64_t hidden, int64_t inter);

  // The shared expert's backward over `tokens` of this rank's tokens x and dy (the caller's);
  // saved_gate_up: its saved pre-activations, or null to recompute them.
  void run_shared_expert(const Fp8WeightCache& weights, const bf16* x, const bf16* dy,
                         const DeviceLayerGradients& grads, int tokens, cudaStream_t stream,
                         const gemm::LaunchOptions& gemm_options, const bf16* saved_gate_up);
  // One rank alone: the routed expert rows of x and dy gathered from the tokens and quantized in
  // one pass: dy's (and, x_rows, x's) 1 x 128 rows and both 128 x 1 operands of the wgrads.
  void quantize_expert_rows(const bf16* x, const bf16* dy, bool x_rows, cudaStream_t stream);
  // Whether the backward takes that path (no dispatch) instead of dispatching the rows.
  bool gathers_expert_rows() const { return workspace_.num_ranks() == 1; }
  // Both wgrads of one group of experts (the routed ones, or the shared expert as one group), their
  // operands quantized 128 x 1 down each expert's rows first (x and dy null: x_t and dy_t are
  // already there): down, then between(), then gate/up.
  template <class Between>
  void weight_gradients(const Operands& op, const bf16* x, const bf16* dy, int groups,
                        int padded_rows, int inter, const int32_t* offsets, const int32_t* counts,
                        void* grad_gate_up, void* grad_down, gemm::WgradOutput output,
                        cudaStream_t stream, const gemm::LaunchOptions& gemm_options,
                        const Between& between);
  template <class Mark>
  void run_routed_experts(const Fp8WeightCache& weights, const DeviceLayerGradients& grads,
                          const bf16* saved_gate_up, cudaStream_t stream, const Mark& mark);

  LayerShape shape_;
  int64_t tokens_max_ = 0;
  LayerBackwardOptions options_;
  gemm::Fp8Pipeline pipeline_;
  CommWorkspace workspace_;
  int num_sms_ = 0;
  SideStream side_;  // the dispatch, when it overlaps the shared expert
  Operands routed_, shared_;
  int64_t routed_padded_rows_ = 0;     // rows_capacity rounded up to 128
  float* ones_ = nullptr;              // (T_max, k) 1.0f: the reduce's weights for dx
  float* shared_dx_ = nullptr;         // (T_max, H) fp32
  int32_t* shared_offsets_ = nullptr;  // (2): 0, T of the current call
};

}  // namespace mok
