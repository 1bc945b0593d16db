// The GPU forward of one MoE layer in precision mode fp8 (DESIGN.md §3, the DeepSeek-V3 recipe)
// on one expert-parallel rank, composed from the tested engines as the unfused bf16 forward is
// (layer_forward.hpp), at the CPU reference's rounding points (src/reference/quantized_engine.cpp):
//
//   tokens                    x quantized 1 x 128 along H on its own rank, staged in the window
//                             as packed rows (stage_fp8_tokens: H E4M3 bytes, then the scales)
//   schedule                  as bf16
//   shared expert             gate/up FP8 GEMM on the quantized tokens with h = swiglu quantized
//                             1 x 128 from fp32 in its epilogue; down FP8 GEMM, fp32 (the combine
//                             adds it before its one rounding); beside the dispatch where it can be
//   dispatch                  the routed rows' E4M3 bytes and scales pulled from the owners'
//                             windows (dispatch_fp8; global token order): every copy of a token
//                             gets its owner's quantization's bytes, half the bf16 rows' bytes
//   routed gate/up + SwiGLU   FP8 GEMM; its epilogue quantizes h = swiglu(gate, up) 1 x 128 along
//                             I from the fp32 sums (gemm::grouped_swiglu_fp8)
//   routed down               FP8 GEMM -> expert_y bf16 (the slot rows' one rounding)
//   combine_push, _reduce     as bf16: y = shared + Σ_j w_j · slot_j in fp32, rounded once
//
// The weights are quantized 128 x 128 (W_gate, W_up and W_down each in its own blocks) into a
// cache (fp8_weights.hpp) by quantize_weights, once per change of the weights (an optimizer step),
// not per call.
// Fp8SwiGlu::kSeparate keeps the gate/up sums in fp32 and quantizes h in a kernel of its own: the
// same bytes (the test of the fused epilogue), more memory traffic.
// Asynchronous on the caller's stream, no host synchronisation. Construction and destruction are
// collective (see CommWorkspace).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "mok/bf16.hpp"
#include "mok/gemm_fp8.hpp"
#include "mok/layer.hpp"
#include "runtime/comm.hpp"
#include "runtime/fp8_weights.hpp"
#include "runtime/layer_forward.hpp"
#include "runtime/side_stream.hpp"
#include "runtime/workspace.hpp"

namespace mok {

// Where h = swiglu(gate, up) is computed and quantized.
enum class Fp8SwiGlu {
  kInGemm,    // in the gate/up GEMM's epilogue
  kSeparate,  // gate/up sums to fp32 memory, then a kernel
};

struct LayerForwardFp8Options {
  LayerForwardOptions layer;  // copies, GEMM grid, workspace, overlap (fused: not used)
  Fp8SwiGlu swiglu = Fp8SwiGlu::kInGemm;
  // The FP8 GEMMs' clusters and ring (same bits whichever). Single CTAs: with an expert's 2-3 M
  // blocks at EP 1, a cluster's second CTA often has no rows and idles through the K loop; the
  // forward measured faster at deepseek-v3 and qwen3-30b-a3b, level elsewhere
  // (docs/perf-notes/fp8.md).
  gemm::Fp8Pipeline pipeline{/*cluster=*/1, /*stages=*/0};
  // The weight cache holds the dgrads' transposed layout too (fp8_weights.hpp), made by the same
  // quantize_weights, for a LayerBackwardFp8 of the same layer to read (weight_cache()).
  bool transposed_weights = false;
};

class LayerForwardFp8 {
 public:
  // tokens_max: the most tokens any call passes on any rank. H, I and I_s multiples of 128
  // (validate_precision). options.fused is not used (this path is not fused yet).
  LayerForwardFp8(const Communicator& comm, const LayerShape& shape, int64_t tokens_max,
                  const LayerForwardFp8Options& options = {});
  ~LayerForwardFp8();
  LayerForwardFp8(const LayerForwardFp8&) = delete;
  LayerForwardFp8& operator=(const LayerForwardFp8&) = delete;

  // Quantizes the bf16 weights (DeviceLayerWeights' layouts: gate/up interleaved in blocks of 8
  // rows) into this object's cache, on `stream`; the forwards after it read the cache. Call it
  // again whenever the weights change.
  void quantize_weights(const DeviceLayerWeights& weights, cudaStream_t stream) {
    weights_.quantize(weights, stream);
  }
  bool has_weights() const { return weights_.has_weights(); }
  // The cache (fp8_weights.hpp's forward layout), and the whole cache.
  const Fp8LayerWeights& weights() const { return weights_.forward(); }
  const Fp8WeightCache& weight_cache() const { return weights_; }

  // x (T, H) bf16, topk_idx (T, k) int32, topk_w (T, k) fp32, y (T, H) bf16, on this rank's GPU;
  // T <= tokens_max. phase_events, when given: kNumForwardPhases + 1 events, recorded before the
  // first phase and after each (ForwardPhase; kFused takes no time). save: keep the context there
  // for LayerBackwardFp8 (save mode, Fp8SwiGlu::kInGemm only): SavedContext's layout and rows
  // (saved_context_rows), the gate/up sums rounded to bf16 in the FP8 weight cache's column order
  // (gate and up interleaved in blocks of 128). Throws mok::Error before enqueueing anything when
  // quantize_weights has not run.
  void forward(const bf16* x, const int32_t* topk_idx, const float* topk_w, bf16* y,
               int64_t num_tokens, cudaStream_t stream, const cudaEvent_t* phase_events = nullptr,
               const SavedContext* save = nullptr);

  // Waits for `stream` and throws mok::Error naming rank, phase and cause of a device fault.
  void check(cudaStream_t stream) const { workspace_.check(stream); }
  CommWorkspace& workspace() { return workspace_; }
  const LayerShape& shape() const { return shape_; }
  int64_t tokens_max() const { return tokens_max_; }
  // Device bytes besides the weight cache: workspace and intermediates; the static one without a
  // layer (what one of these arguments would hold).
  int64_t buffer_bytes() const;
  static int64_t buffer_bytes(const LayerShape& shape, int num_ranks, int64_t tokens_max,
                              const LayerForwardFp8Options& options = {});
  // Device bytes of the weight cache (E4M3 bytes and scales).
  int64_t weight_bytes() const { return weights_.bytes(); }

 private:
  void run_shared_expert(int64_t num_tokens, cudaStream_t stream,
                         const gemm::LaunchOptions& gemm_options, bf16* saved_gate_up);
  // x (rows, H) · w (E, 2I, H)ᵀ -> h (rows, I) E4M3 and scales, SwiGLU as swiglu_ says (kSeparate:
  // the sums through `sums`, then h for the rows below *row_bound, or all rows when null); saved:
  // the sums in bf16 too (save mode; row r at saved_rows[r], or r when null), or null.
  void gate_up_swiglu(const gemm::GroupedShape& shape, const Fp8Operand& x, const Fp8Operand& w,
                      const int32_t* offsets, float* sums, const Fp8Operand& h,
                      const int32_t* row_bound, cudaStream_t stream,
                      const gemm::LaunchOptions& gemm_options, bf16* saved,
                      const int32_t* saved_rows);

  LayerShape shape_;
  int64_t tokens_max_ = 0;
  LayerForwardOptions options_;
  Fp8SwiGlu swiglu_ = Fp8SwiGlu::kInGemm;
  gemm::Fp8Pipeline pipeline_;
  CommWorkspace workspace_;
  Fp8WeightCache weights_;
  Fp8Operand routed_x_;              // (rows, H), scales (rows, H / 128)
  float* routed_gate_up_ = nullptr;  // (rows, 2I) fp32 (kSeparate only)
  Fp8Operand routed_hidden_;         // (rows, I), scales (rows, I / 128)
  Fp8Operand token_x_;               // (T_max, H): this rank's tokens, 1 x 128
  float* shared_gate_up_ = nullptr;  // (T_max, 2I_s) fp32 (kSeparate only)
  Fp8Operand shared_hidden_;         // (T_max, I_s)
  float* shared_output_ = nullptr;   // (T_max, H) fp32
  int32_t* shared_offsets_ = nullptr;
  int num_sms_ = 0;
  SideStream side_;  // the dispatch, when it overlaps the shared expert
};

}  // namespace mok
