// The layer computed on the CPU for R virtual ranks, templated on the arithmetic:
//   float  — the GPU design's rounding points (bf16 storage of h, of expert output rows, of y/dx;
//            fp32 accumulation in natural order);
//   double — the fp64 oracle: the same formulas, nothing rounded.
// Each output element is produced by one work item with a fixed order of operations, so threads
// change nothing; expert rows are visited in global-token order, so R changes nothing either.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "mok/bf16.hpp"
#include "mok/detail/numerics.hpp"
#include "mok/reference.hpp"
#include "reference/parallel.hpp"
#include "reference/schedule.hpp"

namespace mok::reference {

template <class Real>
struct Arithmetic;

template <>
struct Arithmetic<float> {
  static float store(float value) { return round_to_bf16(value); }
};

template <>
struct Arithmetic<double> {
  static double store(double value) { return value; }
};

// Where one rank's weight gradients go; initialised by the caller (zero or main_grad).
template <class Real>
struct GradTargets {
  Real* gate = nullptr;  // (E_local, I, H)
  Real* up = nullptr;
  Real* down = nullptr;         // (E_local, H, I)
  Real* shared_gate = nullptr;  // (I_s, H)
  Real* shared_up = nullptr;
  Real* shared_down = nullptr;  // (H, I_s)
};

template <class Real>
struct RankResult {
  std::vector<Real> y;         // (T, H), rounded as stored
  std::vector<Real> dx;        // (T, H)
  std::vector<Real> d_topk_w;  // (T, k)
};

template <class Real>
class LayerEngine {
 public:
  LayerEngine(const LayerShape& shape, std::span<const RankInputs> ranks, const Options& options)
      : shape_(shape),
        ranks_(ranks),
        num_threads_(resolve_num_threads(options.num_threads)),
        progress_(options.progress),
        experts_per_rank_(shape.num_experts / static_cast<int64_t>(ranks.size())) {
    std::vector<TokenBatch> batches;
    for (const RankInputs& rank : ranks) batches.push_back(rank.tokens);
    schedule_ = build_schedule(shape, batches);
    expert_of_row_ = schedule_.expert_of_rows();
  }

  std::vector<RankResult<Real>> forward();
  std::vector<RankResult<Real>> backward(std::span<const GradTargets<Real>> grads);

 private:
  using Store = Arithmetic<Real>;

  struct ExpertWeights {
    const bf16* gate;  // (I, H)
    const bf16* up;    // (I, H)
    const bf16* down;  // (H, I)
  };

  int64_t num_ranks() const { return static_cast<int64_t>(ranks_.size()); }
  int64_t num_tokens(int64_t rank) const { return ranks_[rank].tokens.x.shape[0]; }
  ExpertWeights routed_weights(int64_t expert) const;
  ExpertWeights shared_weights(int64_t rank) const;
  const bf16* token_row(const View<const bf16>& tensor, int64_t token) const {
    return tensor.data + token * shape_.hidden;
  }

  // Sequential dot product in natural order; bf16 x bf16 products are exact in fp32.
  static Real dot(const bf16* weights, const Real* values, int64_t length) {
    Real sum = 0;
    for (int64_t index = 0; index < length; ++index) {
      sum = sum + static_cast<Real>(weights[index].to_float()) * values[index];
    }
    return sum;
  }
  static void load(const bf16* source, int64_t length, Real* destination) {
    for (int64_t index = 0; index < length; ++index) destination[index] = source[index].to_float();
  }

  // SwiGLU expert on one token: x (H) -> gate, up (I), h (I, rounded for storage).
  void expert_hidden(const ExpertWeights& weights, int64_t inter, const Real* x, Real* gate,
                     Real* up, Real* h) const;
  // The backward's view of the same: gate and up as the backward keeps them (rounded for storage,
  // as a saved context holds them, DESIGN.md §3) and h computed again from those.
  void backward_hidden(const ExpertWeights& weights, int64_t inter, const Real* x, Real* gate,
                       Real* up, Real* h) const;
  // out (H) = W_down h, unrounded.
  void expert_output(const ExpertWeights& weights, int64_t inter, const Real* h, Real* out) const;
  // gvec (I) = W_downᵀ dy: for each i the sum runs over n in natural order.
  void down_dgrad(const ExpertWeights& weights, int64_t inter, const Real* dy, Real* gvec) const;
  // dx (H) = W_gateᵀ d_gate + W_upᵀ d_up, gate rows first, each i in order; unrounded.
  void input_dgrad(const ExpertWeights& weights, int64_t inter, const Real* d_gate,
                   const Real* d_up, Real* dx) const;
  // The shared expert's output (forward) for every token of every rank, fp32, unrounded.
  std::vector<std::vector<Real>> shared_forward();

  const LayerShape& shape_;
  std::span<const RankInputs> ranks_;
  int num_threads_;
  ProgressFn progress_;
  int64_t experts_per_rank_;
  ExpertSchedule schedule_;
  std::vector<int32_t> expert_of_row_;  // (rows)
};

extern template class LayerEngine<float>;
extern template class LayerEngine<double>;

}  // namespace mok::reference
