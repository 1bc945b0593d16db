// The layer in an FP8 precision mode (fp8, mxfp8) for R virtual ranks, templated like LayerEngine:
//   float  — the GPU design's rounding points: E4M3 operands, K sums promoted per block in fp32
//            (block_scaled.hpp), bf16 where the bf16 path stores bf16 (expert output rows, y, dx,
//            the backward's pre-activations);
//   double — the same quantized operands, everything else in fp64 with nothing rounded: the
//            "quantize, then compute in fp64" oracle the accuracy tests measure the recipe by.
// The quantization points are listed in docs/quantize.md ("The layer in FP8"). Every operand
// quantized along tokens is taken over an expert's rows in global-token order, so, as in
// LayerEngine, nothing depends on R or on the thread count.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "mok/precision.hpp"
#include "mok/reference.hpp"
#include "reference/block_scaled.hpp"
#include "reference/engine.hpp"
#include "reference/schedule.hpp"

namespace mok::reference {

// The blocks of one recipe. Every GEMM's K is cut in blocks of `block` (0: one block, all of K);
// activations are quantized 1 x block along K, weights weight_rows x block, and the weight
// gradients' operands block x 1 down the tokens.
struct QuantRecipe {
  quantize::Format format = quantize::Format::kFp8;
  int64_t block = 128;
  int64_t weight_rows = 128;

  static QuantRecipe of(Precision precision);  // kFp8 or kMxfp8
  // fp8 with one scale per row of every operand over all of K: the per-row recipe the blockwise
  // one is compared with.
  static QuantRecipe rowwise_fp8() { return {quantize::Format::kFp8, 0, 1}; }

  BlockScaling activations() const { return {format, 1, block}; }
  BlockScaling weights() const { return {format, weight_rows, block}; }
};

template <class Real>
class QuantizedEngine {
 public:
  QuantizedEngine(const LayerShape& shape, std::span<const RankInputs> ranks,
                  const Options& options, const QuantRecipe& recipe);

  std::vector<RankResult<Real>> forward();
  std::vector<RankResult<Real>> backward(std::span<const GradTargets<Real>> grads);

  // Rank r's tokens x (T, H) as the layer quantizes them, once, before the dispatch: the operand
  // of every routed and shared gate/up GEMM row of those tokens.
  const QuantizedMatrix& quantized_x(int64_t rank) const { return quantized_x_[rank]; }

 private:
  // One expert's weights as the GEMMs read them.
  struct ExpertOperands {
    QuantizedMatrix gate, up;   // (I, H): forward gate/up, K = H
    QuantizedMatrix down;       // (H, I): forward down, K = I
    QuantizedMatrix down_t;     // (I, H): down dgrad gvec = W_downᵀ dy, K = H
    QuantizedMatrix gate_up_t;  // (H, 2I): [W_gateᵀ | W_upᵀ], gate/up dgrad, K = 2I
  };
  // Per row of an expert (routed) or token (shared): what the backward passes on.
  struct RowGrads {
    std::vector<Real> d_gate_up;  // (rows, 2I): d_gate then d_up, unrounded
    std::vector<Real> hidden;     // (rows, I): w·h (routed) or h (shared), unrounded
  };

  int64_t num_ranks() const { return static_cast<int64_t>(ranks_.size()); }
  int64_t num_tokens(int64_t rank) const { return ranks_[rank].tokens.x.shape[0]; }
  ExpertOperands quantize_expert(const bf16* gate, const bf16* up, const bf16* down, int64_t inter,
                                 bool with_dgrad) const;
  std::vector<ExpertOperands> quantize_routed(bool with_dgrad) const;
  std::vector<ExpertOperands> quantize_shared(bool with_dgrad) const;
  QuantizedMatrix quantize_tokens(const View<const bf16>& tensor) const;  // (T, H), 1 x block
  QuantizedMatrix quantize_values(const Real* values, int64_t rows, int64_t cols,
                                  const BlockScaling& scaling) const;

  // gate, up (I) for one token row of x; h = swiglu(gate, up) in Real, unrounded.
  void gate_up(const ExpertOperands& expert, int64_t inter, const QuantizedMatrix& x, int64_t token,
               Real* gate, Real* up) const;
  // out (H) = W_down h with h quantized 1 x block along I; unrounded.
  void down(const ExpertOperands& expert, int64_t inter, const Real* h, Real* out) const;
  // The backward of one row: gvec, d_topk_w (returned), d_gate | d_up and the down-wgrad operand
  // (weight · h) into grads at row_idx, the row's dx (H, unrounded) into dx.
  Real backward_row(const ExpertOperands& expert, int64_t inter, int64_t token, int64_t rank,
                    Real weight, RowGrads& grads, int64_t row_idx, Real* dx) const;
  // Weight gradients of one expert from its rows [row_begin, row_end) of `grads`, whose tokens
  // are tokens[...] in order: operands quantized block x 1 along those rows.
  struct TokenRef {
    int64_t rank, token;
  };
  void weight_grads(const std::vector<TokenRef>& tokens, const RowGrads& grads, int64_t row_begin,
                    int64_t inter, Real* grad_gate, Real* grad_up, Real* grad_down) const;

  const LayerShape& shape_;
  std::span<const RankInputs> ranks_;
  int num_threads_;
  ProgressFn progress_;
  QuantRecipe recipe_;
  int64_t experts_per_rank_;
  ExpertSchedule schedule_;
  std::vector<int32_t> expert_of_row_;         // (rows)
  std::vector<QuantizedMatrix> quantized_x_;   // per rank (T, H)
  std::vector<QuantizedMatrix> quantized_dy_;  // per rank (T, H); backward only
};

extern template class QuantizedEngine<float>;
extern template class QuantizedEngine<double>;

}  // namespace mok::reference
