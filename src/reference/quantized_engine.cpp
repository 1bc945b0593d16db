#include "reference/quantized_engine.hpp"

#include "mok/error.hpp"
#include "reference/combine.hpp"

namespace mok::reference {

QuantRecipe QuantRecipe::of(Precision precision) {
  MOK_CHECK_ARG(precision == Precision::kFp8 || precision == Precision::kMxfp8, "precision",
                "no FP8 recipe for ", precision_name(precision));
  if (precision == Precision::kFp8) return {quantize::Format::kFp8, 128, 128};
  return {quantize::Format::kMxfp8, 32, 1};
}

template <class Real>
QuantizedEngine<Real>::QuantizedEngine(const LayerShape& shape, std::span<const RankInputs> ranks,
                                       const Options& options, const QuantRecipe& recipe)
    : shape_(shape),
      ranks_(ranks),
      num_threads_(resolve_num_threads(options.num_threads)),
      progress_(options.progress),
      recipe_(recipe),
      experts_per_rank_(shape.num_experts / static_cast<int64_t>(ranks.size())) {
  std::vector<TokenBatch> batches;
  for (const RankInputs& rank : ranks) batches.push_back(rank.tokens);
  schedule_ = build_schedule(shape, batches);
  expert_of_row_ = schedule_.expert_of_rows();
  // Each rank quantizes its own tokens before they travel: every expert row of a token, on any
  // rank, reads the same bytes.
  for (const RankInputs& rank : ranks) quantized_x_.push_back(quantize_tokens(rank.tokens.x));
}

template <class Real>
QuantizedMatrix QuantizedEngine<Real>::quantize_values(const Real* values, int64_t rows,
                                                       int64_t cols,
                                                       const BlockScaling& scaling) const {
  std::vector<float> as_float(static_cast<size_t>(rows * cols));
  for (size_t index = 0; index < as_float.size(); ++index) {
    as_float[index] = static_cast<float>(values[index]);
  }
  return quantize_matrix(scaling, as_float.data(), rows, cols);
}

template <class Real>
QuantizedMatrix QuantizedEngine<Real>::quantize_tokens(const View<const bf16>& tensor) const {
  std::vector<float> values(static_cast<size_t>(tensor.numel()));
  for (size_t index = 0; index < values.size(); ++index) {
    values[index] = tensor.data[index].to_float();
  }
  return quantize_matrix(recipe_.activations(), values.data(), tensor.shape[0], shape_.hidden);
}

template <class Real>
typename QuantizedEngine<Real>::ExpertOperands QuantizedEngine<Real>::quantize_expert(
    const bf16* gate, const bf16* up, const bf16* down, int64_t inter, bool with_dgrad) const {
  const int64_t hidden = shape_.hidden;
  const int64_t matrix = inter * hidden;
  std::vector<float> gate_values(gate, gate + matrix), up_values(up, up + matrix),
      down_values(down, down + matrix);
  const BlockScaling scaling = recipe_.weights();
  ExpertOperands out;
  out.gate = quantize_matrix(scaling, gate_values.data(), inter, hidden);
  out.up = quantize_matrix(scaling, up_values.data(), inter, hidden);
  out.down = quantize_matrix(scaling, down_values.data(), hidden, inter);
  if (!with_dgrad) return out;
  // The dgrad GEMMs contract over the weights' other dimension: the transposed copies, blocked
  // along their own K. fp8's 128 x 128 blocks are the same squares either way (the same bytes);
  // mxfp8's 1 x 32 blocks now run down the columns of the forward layout.
  std::vector<float> down_t(static_cast<size_t>(matrix)),
      gate_up_t(static_cast<size_t>(2 * matrix));
  for (int64_t n = 0; n < hidden; ++n) {
    for (int64_t i = 0; i < inter; ++i) {
      down_t[i * hidden + n] = down_values[n * inter + i];
      gate_up_t[n * 2 * inter + i] = gate_values[i * hidden + n];
      gate_up_t[n * 2 * inter + inter + i] = up_values[i * hidden + n];
    }
  }
  out.down_t = quantize_matrix(scaling, down_t.data(), inter, hidden);
  out.gate_up_t = quantize_matrix(scaling, gate_up_t.data(), hidden, 2 * inter);
  return out;
}

template <class Real>
std::vector<typename QuantizedEngine<Real>::ExpertOperands> QuantizedEngine<Real>::quantize_routed(
    bool with_dgrad) const {
  const int64_t matrix = shape_.intermediate * shape_.hidden;
  std::vector<ExpertOperands> experts(static_cast<size_t>(shape_.num_experts));
  parallel_for(shape_.num_experts, num_threads_, [&](int64_t expert, int) {
    const LayerWeights& weights = ranks_[expert / experts_per_rank_].weights;
    const int64_t offset = (expert % experts_per_rank_) * matrix;
    experts[expert] = quantize_expert(weights.gate.data + offset, weights.up.data + offset,
                                      weights.down.data + offset, shape_.intermediate, with_dgrad);
  });
  return experts;
}

template <class Real>
std::vector<typename QuantizedEngine<Real>::ExpertOperands> QuantizedEngine<Real>::quantize_shared(
    bool with_dgrad) const {
  std::vector<ExpertOperands> experts(ranks_.size());
  if (!shape_.has_shared()) return experts;
  parallel_for(num_ranks(), num_threads_, [&](int64_t rank, int) {
    const LayerWeights& weights = ranks_[rank].weights;
    experts[rank] =
        quantize_expert(weights.shared_gate.data, weights.shared_up.data, weights.shared_down.data,
                        shape_.shared_intermediate, with_dgrad);
  });
  return experts;
}

template <class Real>
void QuantizedEngine<Real>::gate_up(const ExpertOperands& expert, int64_t inter,
                                    const QuantizedMatrix& x, int64_t token, Real* gate,
                                    Real* up) const {
  for (int64_t i = 0; i < inter; ++i) {
    gate[i] = block_scaled_dot<Real>(x, token, expert.gate, i);
    up[i] = block_scaled_dot<Real>(x, token, expert.up, i);
  }
}

template <class Real>
void QuantizedEngine<Real>::down(const ExpertOperands& expert, int64_t inter, const Real* h,
                                 Real* out) const {
  const QuantizedMatrix hidden_row = quantize_values(h, 1, inter, recipe_.activations());
  for (int64_t n = 0; n < shape_.hidden; ++n) {
    out[n] = block_scaled_dot<Real>(hidden_row, 0, expert.down, n);
  }
}

template <class Real>
std::vector<RankResult<Real>> QuantizedEngine<Real>::forward() {
  using Store = Arithmetic<Real>;
  const int64_t hidden = shape_.hidden, inter = shape_.intermediate, top_k = shape_.top_k;
  const std::vector<ExpertOperands> routed = quantize_routed(/*with_dgrad=*/false);
  std::vector<std::vector<Real>> slots(ranks_.size());
  std::vector<std::vector<Real>> shared(ranks_.size());
  for (int64_t rank = 0; rank < num_ranks(); ++rank) {
    slots[rank].assign(static_cast<size_t>(num_tokens(rank) * top_k * hidden), 0);
    shared[rank].assign(static_cast<size_t>(num_tokens(rank) * hidden), 0);
  }
  parallel_for(
      static_cast<int64_t>(schedule_.rows.size()), num_threads_,
      [&](int64_t row_idx, int) {
        const RowRef row = schedule_.rows[row_idx];
        std::vector<Real> gate(inter), up(inter), h(inter), out(hidden);
        const ExpertOperands& expert = routed[expert_of_row_[row_idx]];
        gate_up(expert, inter, quantized_x_[row.rank], row.token, gate.data(), up.data());
        for (int64_t i = 0; i < inter; ++i) h[i] = numerics::swiglu(gate[i], up[i]);
        down(expert, inter, h.data(), out.data());
        Real* slot = slots[row.rank].data() + (row.token * top_k + row.slot) * hidden;
        for (int64_t n = 0; n < hidden; ++n) slot[n] = Store::store(out[n]);
      },
      "forward: routed experts", progress_);

  if (shape_.has_shared()) {
    const int64_t shared_inter = shape_.shared_intermediate;
    const std::vector<ExpertOperands> experts = quantize_shared(/*with_dgrad=*/false);
    for (int64_t rank = 0; rank < num_ranks(); ++rank) {
      parallel_for(
          num_tokens(rank), num_threads_,
          [&](int64_t token, int) {
            std::vector<Real> gate(shared_inter), up(shared_inter), h(shared_inter);
            gate_up(experts[rank], shared_inter, quantized_x_[rank], token, gate.data(), up.data());
            for (int64_t i = 0; i < shared_inter; ++i) h[i] = numerics::swiglu(gate[i], up[i]);
            down(experts[rank], shared_inter, h.data(), shared[rank].data() + token * hidden);
          },
          "forward: shared expert", progress_);
    }
  }

  std::vector<RankResult<Real>> results(ranks_.size());
  for (int64_t rank = 0; rank < num_ranks(); ++rank) {
    results[rank].y = combine_slots<Real, Store>(ranks_[rank].tokens, top_k, hidden, slots[rank],
                                                 shared[rank], /*weighted=*/true, num_threads_);
  }
  return results;
}

template <class Real>
Real QuantizedEngine<Real>::backward_row(const ExpertOperands& expert, int64_t inter, int64_t token,
                                         int64_t rank, Real weight, RowGrads& grads,
                                         int64_t row_idx, Real* dx) const {
  using Store = Arithmetic<Real>;
  std::vector<Real> gate(inter), up(inter), gvec(inter);
  // The pre-activations as the backward holds them: bf16, as a saved context keeps them.
  gate_up(expert, inter, quantized_x_[rank], token, gate.data(), up.data());
  for (int64_t i = 0; i < inter; ++i) {
    gate[i] = Store::store(gate[i]);
    up[i] = Store::store(up[i]);
    gvec[i] = block_scaled_dot<Real>(quantized_dy_[rank], token, expert.down_t, i);
  }
  Real d_weight = 0;
  Real* d_gate_up = grads.d_gate_up.data() + row_idx * 2 * inter;
  Real* hidden_row = grads.hidden.data() + row_idx * inter;
  for (int64_t i = 0; i < inter; ++i) {
    const Real h = numerics::swiglu(gate[i], up[i]);
    d_weight = d_weight + gvec[i] * h;
    const auto grad = numerics::swiglu_backward(gate[i], up[i], weight * gvec[i]);
    d_gate_up[i] = grad.d_gate;
    d_gate_up[inter + i] = grad.d_up;
    hidden_row[i] = weight * h;
  }
  const QuantizedMatrix d_row = quantize_values(d_gate_up, 1, 2 * inter, recipe_.activations());
  for (int64_t n = 0; n < shape_.hidden; ++n) {
    dx[n] = block_scaled_dot<Real>(d_row, 0, expert.gate_up_t, n);
  }
  return d_weight;
}

template <class Real>
void QuantizedEngine<Real>::weight_grads(const std::vector<TokenRef>& tokens, const RowGrads& grads,
                                         int64_t row_begin, int64_t inter, Real* grad_gate,
                                         Real* grad_up, Real* grad_down) const {
  const int64_t count = static_cast<int64_t>(tokens.size());
  if (count == 0) return;  // an expert without rows: its gradients stay as they are
  const int64_t hidden = shape_.hidden;
  // Every operand transposed to (features, rows), K = the rows in order, quantized 1 x block
  // along them: blocks of `block` consecutive rows from the first.
  std::vector<Real> d_gate_up_t(static_cast<size_t>(2 * inter * count)),
      hidden_t(static_cast<size_t>(inter * count));
  std::vector<float> x_t(static_cast<size_t>(hidden * count)), dy_t(x_t.size());
  for (int64_t r = 0; r < count; ++r) {
    const int64_t row = row_begin + r;
    for (int64_t c = 0; c < 2 * inter; ++c) {
      d_gate_up_t[c * count + r] = grads.d_gate_up[row * 2 * inter + c];
    }
    for (int64_t i = 0; i < inter; ++i) hidden_t[i * count + r] = grads.hidden[row * inter + i];
    const RankInputs& source = ranks_[tokens[r].rank];
    const bf16* x = source.tokens.x.data + tokens[r].token * hidden;
    const bf16* dy = source.dy.data + tokens[r].token * hidden;
    for (int64_t n = 0; n < hidden; ++n) {
      x_t[n * count + r] = x[n].to_float();
      dy_t[n * count + r] = dy[n].to_float();
    }
  }
  const BlockScaling along_rows = recipe_.activations();
  const QuantizedMatrix d_gate_up_q =
      quantize_values(d_gate_up_t.data(), 2 * inter, count, along_rows);
  const QuantizedMatrix hidden_q = quantize_values(hidden_t.data(), inter, count, along_rows);
  const QuantizedMatrix x_q = quantize_matrix(along_rows, x_t.data(), hidden, count);
  const QuantizedMatrix dy_q = quantize_matrix(along_rows, dy_t.data(), hidden, count);
  // Items: 2I rows of the gate/up gradients (H elements each), then H rows of the down gradient
  // (I each); every element starts from what its buffer holds (0 or main_grad).
  parallel_for(2 * inter + hidden, num_threads_, [&](int64_t item, int) {
    if (item < 2 * inter) {
      Real* target = item < inter ? grad_gate + item * hidden : grad_up + (item - inter) * hidden;
      for (int64_t n = 0; n < hidden; ++n) {
        target[n] = block_scaled_dot<Real>(d_gate_up_q, item, x_q, n, target[n]);
      }
    } else {
      const int64_t n = item - 2 * inter;
      Real* target = grad_down + n * inter;
      for (int64_t i = 0; i < inter; ++i) {
        target[i] = block_scaled_dot<Real>(dy_q, n, hidden_q, i, target[i]);
      }
    }
  });
}

template <class Real>
std::vector<RankResult<Real>> QuantizedEngine<Real>::backward(
    std::span<const GradTargets<Real>> grads) {
  using Store = Arithmetic<Real>;
  const int64_t hidden = shape_.hidden, inter = shape_.intermediate, top_k = shape_.top_k;
  const int64_t num_rows = static_cast<int64_t>(schedule_.rows.size());
  // dy is quantized on its token's own rank before it travels to the experts.
  quantized_dy_.clear();
  for (const RankInputs& rank : ranks_) quantized_dy_.push_back(quantize_tokens(rank.dy));
  const std::vector<ExpertOperands> routed = quantize_routed(/*with_dgrad=*/true);

  std::vector<RankResult<Real>> results(ranks_.size());
  std::vector<std::vector<Real>> dx_slots(ranks_.size());
  for (int64_t rank = 0; rank < num_ranks(); ++rank) {
    results[rank].d_topk_w.assign(static_cast<size_t>(num_tokens(rank) * top_k), 0);
    dx_slots[rank].assign(static_cast<size_t>(num_tokens(rank) * top_k * hidden), 0);
  }
  RowGrads routed_grads{std::vector<Real>(static_cast<size_t>(num_rows * 2 * inter)),
                        std::vector<Real>(static_cast<size_t>(num_rows * inter))};
  parallel_for(
      num_rows, num_threads_,
      [&](int64_t row_idx, int) {
        const RowRef row = schedule_.rows[row_idx];
        const Real weight = ranks_[row.rank].tokens.topk_w.data[row.token * top_k + row.slot];
        std::vector<Real> dx(hidden);
        results[row.rank].d_topk_w[row.token * top_k + row.slot] =
            backward_row(routed[expert_of_row_[row_idx]], inter, row.token, row.rank, weight,
                         routed_grads, row_idx, dx.data());
        Real* slot = dx_slots[row.rank].data() + (row.token * top_k + row.slot) * hidden;
        for (int64_t n = 0; n < hidden; ++n) slot[n] = Store::store(dx[n]);
      },
      "backward: routed experts", progress_);

  // Routed weight gradients, expert by expert over its rows in global-token order.
  const int64_t matrix = inter * hidden;
  for (int64_t expert = 0; expert < shape_.num_experts; ++expert) {
    std::vector<TokenRef> tokens;
    for (int64_t row = schedule_.offsets[expert]; row < schedule_.offsets[expert + 1]; ++row) {
      tokens.push_back({schedule_.rows[row].rank, schedule_.rows[row].token});
    }
    const GradTargets<Real>& target = grads[expert / experts_per_rank_];
    const int64_t offset = (expert % experts_per_rank_) * matrix;
    weight_grads(tokens, routed_grads, schedule_.offsets[expert], inter, target.gate + offset,
                 target.up + offset, target.down + offset);
  }

  // The shared expert, rank by rank over its tokens in order; its dx stays unrounded until the
  // combine.
  const int64_t shared_inter = shape_.shared_intermediate;
  const std::vector<ExpertOperands> shared = quantize_shared(/*with_dgrad=*/true);
  for (int64_t rank = 0; rank < num_ranks(); ++rank) {
    const int64_t tokens = num_tokens(rank);
    std::vector<Real> shared_dx(static_cast<size_t>(tokens * hidden), 0);
    if (shape_.has_shared()) {
      RowGrads shared_grads{std::vector<Real>(static_cast<size_t>(tokens * 2 * shared_inter)),
                            std::vector<Real>(static_cast<size_t>(tokens * shared_inter))};
      parallel_for(
          tokens, num_threads_,
          [&](int64_t token, int) {
            backward_row(shared[rank], shared_inter, token, rank, /*weight=*/1, shared_grads, token,
                         shared_dx.data() + token * hidden);
          },
          "backward: shared expert", progress_);
      std::vector<TokenRef> token_refs;
      for (int64_t token = 0; token < tokens; ++token) token_refs.push_back({rank, token});
      const GradTargets<Real>& target = grads[rank];
      weight_grads(token_refs, shared_grads, 0, shared_inter, target.shared_gate, target.shared_up,
                   target.shared_down);
    }
    results[rank].dx =
        combine_slots<Real, Store>(ranks_[rank].tokens, top_k, hidden, dx_slots[rank], shared_dx,
                                   /*weighted=*/false, num_threads_);
  }
  return results;
}

template class QuantizedEngine<float>;
template class QuantizedEngine<double>;

}  // namespace mok::reference
