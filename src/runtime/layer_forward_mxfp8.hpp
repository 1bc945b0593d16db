// The GPU forward of one MoE layer in precision mode mxfp8 (DESIGN.md §3, OCP MX: E4M3 with an
// E8M0 scale per 32 values) on one expert-parallel rank. Hopper's tensor cores take no block
// scales, and promoted every 32 of K an FP8 GEMM is bound by its issue slots below the bf16 rate
// (docs/perf-notes/fp8.md, "MXFP8 on Hopper"), so this is a numerics mode on the bf16 engine: every
// operand the reference quantizes is quantized to mxfp8 and dequantized again into bf16 (exact:
// kernels/quantize/mx_round_trip.cuh), and the bf16 GEMMs sum the same exact products as the
// reference's block GEMM, in another order. The composition is the unfused bf16 forward's
// (layer_forward.hpp), at the CPU reference's rounding points (src/reference/quantized_engine.cpp):
//
//   tokens                    x round-tripped 1 x 32 along H on its own rank, staged in the
//                             window as bf16 rows: every copy of a token (the shared expert's
//                             too) reads the same values
//   schedule, dispatch        as bf16
//   gate/up + SwiGLU          bf16 GEMM into fp32 sums; h = swiglu(g, u) from them, round-tripped
//                             1 x 32 along I (kernels/megakernel/swiglu_mxfp8.cuh); save mode
//                             keeps the sums rounded to bf16, as the bf16 layer's context
//   down                      bf16 GEMM -> expert_y bf16 (the shared expert's: fp32)
//   combine_push, _reduce     as bf16
//
// The weights are round-tripped into a cache (mx_weights.hpp) by quantize_weights, once per change
// of the weights. Asynchronous on the caller's stream, no host synchronisation. Construction and
// destruction are collective (see CommWorkspace).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "mok/bf16.hpp"
#include "mok/layer.hpp"
#include "runtime/comm.hpp"
#include "runtime/layer_forward.hpp"
#include "runtime/mx_weights.hpp"
#include "runtime/side_stream.hpp"
#include "runtime/workspace.hpp"

namespace mok {

struct LayerForwardMxfp8Options {
  LayerForwardOptions layer;  // copies, GEMM grid, workspace, overlap (fused: not used)
  // The weight cache holds the dgrads' copy too (mx_weights.hpp), for a LayerBackwardMxfp8 of the
  // same layer to read (weight_cache()).
  bool dgrad_weights = false;
};

class LayerForwardMxfp8 {
 public:
  // tokens_max: the most tokens any call passes on any rank. H, I and I_s multiples of 32
  // (validate_precision).
  LayerForwardMxfp8(const Communicator& comm, const LayerShape& shape, int64_t tokens_max,
                    const LayerForwardMxfp8Options& options = {});
  ~LayerForwardMxfp8();
  LayerForwardMxfp8(const LayerForwardMxfp8&) = delete;
  LayerForwardMxfp8& operator=(const LayerForwardMxfp8&) = delete;

  // Round-trips the bf16 weights (DeviceLayerWeights' layouts) into this object's cache, on
  // `stream`; the forwards after it read the cache. Call it again whenever the weights change.
  void quantize_weights(const DeviceLayerWeights& weights, cudaStream_t stream) {
    weights_.quantize(weights, stream);
  }
  bool has_weights() const { return weights_.has_weights(); }
  const MxWeightCache& weight_cache() const { return weights_; }

  // As LayerForwardFp8::forward: x (T, H) bf16, topk_idx (T, k) int32, topk_w (T, k) fp32, y (T, H)
  // bf16; phase_events: kNumForwardPhases + 1 events (ForwardPhase); save: keep the context for
  // LayerBackwardMxfp8 (SavedContext's layout and rows, gate and up interleaved in blocks of 8).
  // Throws mok::Error before enqueueing anything when quantize_weights has not run.
  void forward(const bf16* x, const int32_t* topk_idx, const float* topk_w, bf16* y,
               int64_t num_tokens, cudaStream_t stream, const cudaEvent_t* phase_events = nullptr,
               const SavedContext* save = nullptr);

  // Waits for `stream` and throws mok::Error naming rank, phase and cause of a device fault.
  void check(cudaStream_t stream) const { workspace_.check(stream); }
  CommWorkspace& workspace() { return workspace_; }
  const LayerShape& shape() const { return shape_; }
  int64_t tokens_max() const { return tokens_max_; }
  // Device bytes besides the weight cache: workspace and intermediates; the static one without a
  // layer.
  int64_t buffer_bytes() const;
  static int64_t buffer_bytes(const LayerShape& shape, int num_ranks, int64_t tokens_max,
                              const LayerForwardMxfp8Options& options = {});
  // Device bytes of the weight cache.
  int64_t weight_bytes() const { return weights_.bytes(); }

 private:
  void run_shared_expert(int64_t num_tokens, cudaStream_t stream,
                         const gemm::LaunchOptions& gemm_options, bf16* saved_gate_up);
  // The SwiGLU of `rows` rows of fp32 sums into round-tripped h (rows below *row_bound when given;
  // rows with a negative row_source skipped); saved: the sums in bf16 too, at row_source's row.
  void swiglu(const float* sums, bf16* hidden, int64_t rows, int64_t inter,
              const int32_t* row_bound, const int32_t* row_source, bf16* saved,
              cudaStream_t stream) const;

  LayerShape shape_;
  int64_t tokens_max_ = 0;
  LayerForwardOptions options_;
  CommWorkspace workspace_;
  MxWeightCache weights_;
  bf16* token_x_ = nullptr;         // (T_max, H): this rank's tokens, round-tripped 1 x 32
  float* routed_sums_ = nullptr;    // (rows, 2I) fp32 gate/up sums
  bf16* routed_hidden_ = nullptr;   // (rows, I)
  float* shared_sums_ = nullptr;    // (T_max, 2I_s)
  bf16* shared_hidden_ = nullptr;   // (T_max, I_s)
  float* shared_output_ = nullptr;  // (T_max, H) fp32
  int32_t* shared_offsets_ = nullptr;
  int num_sms_ = 0;
  SideStream side_;  // the dispatch, when it overlaps the shared expert
};

}  // namespace mok
