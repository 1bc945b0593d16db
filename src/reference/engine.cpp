#include "reference/engine.hpp"

#include <algorithm>

#include "reference/combine.hpp"

namespace mok::reference {

template <class Real>
typename LayerEngine<Real>::ExpertWeights LayerEngine<Real>::routed_weights(int64_t expert) const {
  const LayerWeights& weights = ranks_[expert / experts_per_rank_].weights;
  const int64_t local = expert % experts_per_rank_;
  const int64_t matrix = shape_.intermediate * shape_.hidden;
  return {weights.gate.data + local * matrix, weights.up.data + local * matrix,
          weights.down.data + local * matrix};
}

template <class Real>
typename LayerEngine<Real>::ExpertWeights LayerEngine<Real>::shared_weights(int64_t rank) const {
  const LayerWeights& weights = ranks_[rank].weights;
  return {weights.shared_gate.data, weights.shared_up.data, weights.shared_down.data};
}

template <class Real>
void LayerEngine<Real>::expert_hidden(const ExpertWeights& weights, int64_t inter, const Real* x,
                                      Real* gate, Real* up, Real* h) const {
  const int64_t hidden = shape_.hidden;
  for (int64_t i = 0; i < inter; ++i) {
    gate[i] = dot(weights.gate + i * hidden, x, hidden);
    up[i] = dot(weights.up + i * hidden, x, hidden);
    h[i] = Store::store(numerics::swiglu(gate[i], up[i]));
  }
}

template <class Real>
void LayerEngine<Real>::backward_hidden(const ExpertWeights& weights, int64_t inter, const Real* x,
                                        Real* gate, Real* up, Real* h) const {
  expert_hidden(weights, inter, x, gate, up, h);
  for (int64_t i = 0; i < inter; ++i) {
    gate[i] = Store::store(gate[i]);
    up[i] = Store::store(up[i]);
    h[i] = Store::store(numerics::swiglu(gate[i], up[i]));
  }
}

template <class Real>
void LayerEngine<Real>::expert_output(const ExpertWeights& weights, int64_t inter, const Real* h,
                                      Real* out) const {
  for (int64_t n = 0; n < shape_.hidden; ++n) out[n] = dot(weights.down + n * inter, h, inter);
}

template <class Real>
void LayerEngine<Real>::down_dgrad(const ExpertWeights& weights, int64_t inter, const Real* dy,
                                   Real* gvec) const {
  for (int64_t i = 0; i < inter; ++i) gvec[i] = 0;
  for (int64_t n = 0; n < shape_.hidden; ++n) {
    const bf16* column_run = weights.down + n * inter;  // W_down[n, :]
    for (int64_t i = 0; i < inter; ++i) {
      gvec[i] = gvec[i] + static_cast<Real>(column_run[i].to_float()) * dy[n];
    }
  }
}

template <class Real>
void LayerEngine<Real>::input_dgrad(const ExpertWeights& weights, int64_t inter, const Real* d_gate,
                                    const Real* d_up, Real* dx) const {
  const int64_t hidden = shape_.hidden;
  for (int64_t n = 0; n < hidden; ++n) dx[n] = 0;
  for (int64_t i = 0; i < inter; ++i) {
    const bf16* row = weights.gate + i * hidden;
    for (int64_t n = 0; n < hidden; ++n)
      dx[n] = dx[n] + static_cast<Real>(row[n].to_float()) * d_gate[i];
  }
  for (int64_t i = 0; i < inter; ++i) {
    const bf16* row = weights.up + i * hidden;
    for (int64_t n = 0; n < hidden; ++n)
      dx[n] = dx[n] + static_cast<Real>(row[n].to_float()) * d_up[i];
  }
}

template <class Real>
std::vector<std::vector<Real>> LayerEngine<Real>::shared_forward() {
  const int64_t hidden = shape_.hidden, inter = shape_.shared_intermediate;
  std::vector<std::vector<Real>> outputs(ranks_.size());
  for (int64_t rank = 0; rank < num_ranks(); ++rank) {
    outputs[rank].assign(static_cast<size_t>(num_tokens(rank) * hidden), 0);
  }
  if (!shape_.has_shared()) return outputs;

  std::vector<int64_t> first_item(ranks_.size() + 1, 0);  // flat (rank, token) items
  for (int64_t rank = 0; rank < num_ranks(); ++rank)
    first_item[rank + 1] = first_item[rank] + num_tokens(rank);
  std::vector<std::vector<Real>> scratch(num_threads_, std::vector<Real>(hidden + 3 * inter));
  parallel_for(
      first_item.back(), num_threads_,
      [&](int64_t item, int thread_idx) {
        int64_t rank = 0;
        while (item >= first_item[rank + 1]) ++rank;
        const int64_t token = item - first_item[rank];
        Real* x = scratch[thread_idx].data();
        Real *gate = x + hidden, *up = gate + inter, *h = up + inter;
        load(token_row(ranks_[rank].tokens.x, token), hidden, x);
        const ExpertWeights weights = shared_weights(rank);
        expert_hidden(weights, inter, x, gate, up, h);
        expert_output(weights, inter, h, outputs[rank].data() + token * hidden);
      },
      "forward: shared expert", progress_);
  return outputs;
}

template <class Real>
std::vector<RankResult<Real>> LayerEngine<Real>::forward() {
  const int64_t hidden = shape_.hidden, inter = shape_.intermediate, top_k = shape_.top_k;
  // Combine slots (T, k, H) on each token's own rank: one writer per slot.
  std::vector<std::vector<Real>> slots(ranks_.size());
  for (int64_t rank = 0; rank < num_ranks(); ++rank) {
    slots[rank].assign(static_cast<size_t>(num_tokens(rank) * top_k * hidden), 0);
  }
  std::vector<std::vector<Real>> scratch(num_threads_, std::vector<Real>(hidden * 2 + 3 * inter));
  parallel_for(
      static_cast<int64_t>(schedule_.rows.size()), num_threads_,
      [&](int64_t row_idx, int thread_idx) {
        const RowRef row = schedule_.rows[row_idx];
        Real* x = scratch[thread_idx].data();
        Real *gate = x + hidden, *up = gate + inter, *h = up + inter, *out = h + inter;
        load(token_row(ranks_[row.rank].tokens.x, row.token), hidden, x);
        const ExpertWeights weights = routed_weights(expert_of_row_[row_idx]);
        expert_hidden(weights, inter, x, gate, up, h);
        expert_output(weights, inter, h, out);
        Real* slot = slots[row.rank].data() + (row.token * top_k + row.slot) * hidden;
        for (int64_t n = 0; n < hidden; ++n) slot[n] = Store::store(out[n]);
      },
      "forward: routed experts", progress_);

  const std::vector<std::vector<Real>> shared = shared_forward();
  std::vector<RankResult<Real>> results(ranks_.size());
  for (int64_t rank = 0; rank < num_ranks(); ++rank) {
    results[rank].y = combine_slots<Real, Store>(ranks_[rank].tokens, top_k, hidden, slots[rank],
                                                 shared[rank], /*weighted=*/true, num_threads_);
  }
  return results;
}

template <class Real>
std::vector<RankResult<Real>> LayerEngine<Real>::backward(
    std::span<const GradTargets<Real>> grads) {
  const int64_t hidden = shape_.hidden, inter = shape_.intermediate, top_k = shape_.top_k;
  const int64_t num_rows = static_cast<int64_t>(schedule_.rows.size());
  std::vector<RankResult<Real>> results(ranks_.size());
  std::vector<std::vector<Real>> dx_slots(ranks_.size());
  for (int64_t rank = 0; rank < num_ranks(); ++rank) {
    results[rank].d_topk_w.assign(static_cast<size_t>(num_tokens(rank) * top_k), 0);
    dx_slots[rank].assign(static_cast<size_t>(num_tokens(rank) * top_k * hidden), 0);
  }

  // Per row, the operands of the weight-gradient GEMMs: d_gate, d_up (I) and w*h (I), as stored.
  std::vector<Real> row_d_gate(num_rows * inter), row_d_up(num_rows * inter),
      row_hw(num_rows * inter);
  const int64_t widest = std::max(inter, shape_.shared_intermediate);
  std::vector<std::vector<Real>> scratch(num_threads_, std::vector<Real>(hidden * 3 + 4 * widest));
  parallel_for(
      num_rows, num_threads_,
      [&](int64_t row_idx, int thread_idx) {
        const RowRef row = schedule_.rows[row_idx];
        Real* x = scratch[thread_idx].data();
        Real *dy = x + hidden, *dx = dy + hidden;
        Real *gate = dx + hidden, *up = gate + inter, *h = up + inter, *gvec = h + inter;
        const RankInputs& source = ranks_[row.rank];
        load(token_row(source.tokens.x, row.token), hidden, x);
        load(token_row(source.dy, row.token), hidden, dy);
        const ExpertWeights weights = routed_weights(expert_of_row_[row_idx]);
        backward_hidden(weights, inter, x, gate, up, h);
        down_dgrad(weights, inter, dy, gvec);  // on the unscaled dy row

        const Real weight = source.tokens.topk_w.data[row.token * top_k + row.slot];
        Real d_weight = 0;
        Real* d_gate = row_d_gate.data() + row_idx * inter;
        Real* d_up = row_d_up.data() + row_idx * inter;
        for (int64_t i = 0; i < inter; ++i) {
          d_weight = d_weight + gvec[i] * h[i];
          const auto grad = numerics::swiglu_backward(gate[i], up[i], weight * gvec[i]);
          d_gate[i] = Store::store(grad.d_gate);
          d_up[i] = Store::store(grad.d_up);
          row_hw[row_idx * inter + i] = Store::store(weight * h[i]);
        }
        results[row.rank].d_topk_w[row.token * top_k + row.slot] = d_weight;
        input_dgrad(weights, inter, d_gate, d_up, dx);
        Real* slot = dx_slots[row.rank].data() + (row.token * top_k + row.slot) * hidden;
        for (int64_t n = 0; n < hidden; ++n) slot[n] = Store::store(dx[n]);
      },
      "backward: routed experts", progress_);

  // Routed weight gradients: each element sums over its expert's rows in schedule order.
  const int64_t num_experts = shape_.num_experts;
  parallel_for(
      num_experts * inter, num_threads_,
      [&](int64_t item, int) {
        const int64_t expert = item / inter, i = item % inter;
        const GradTargets<Real>& target = grads[expert / experts_per_rank_];
        const int64_t local = expert % experts_per_rank_;
        Real* grad_gate = target.gate + (local * inter + i) * hidden;
        Real* grad_up = target.up + (local * inter + i) * hidden;
        for (int64_t row_idx = schedule_.offsets[expert]; row_idx < schedule_.offsets[expert + 1];
             ++row_idx) {
          const RowRef row = schedule_.rows[row_idx];
          const bf16* x = token_row(ranks_[row.rank].tokens.x, row.token);
          const Real d_gate = row_d_gate[row_idx * inter + i], d_up = row_d_up[row_idx * inter + i];
          for (int64_t n = 0; n < hidden; ++n) {
            const Real x_value = x[n].to_float();
            grad_gate[n] = grad_gate[n] + d_gate * x_value;
            grad_up[n] = grad_up[n] + d_up * x_value;
          }
        }
      },
      "backward: wgrad gate/up", progress_);
  parallel_for(
      num_experts * hidden, num_threads_,
      [&](int64_t item, int) {
        const int64_t expert = item / hidden, n = item % hidden;
        const GradTargets<Real>& target = grads[expert / experts_per_rank_];
        Real* grad_down = target.down + ((expert % experts_per_rank_) * hidden + n) * inter;
        for (int64_t row_idx = schedule_.offsets[expert]; row_idx < schedule_.offsets[expert + 1];
             ++row_idx) {
          const RowRef row = schedule_.rows[row_idx];
          const Real dy = token_row(ranks_[row.rank].dy, row.token)[n].to_float();
          const Real* hw = row_hw.data() + row_idx * inter;
          for (int64_t i = 0; i < inter; ++i) grad_down[i] = grad_down[i] + dy * hw[i];
        }
      },
      "backward: wgrad down", progress_);

  // Shared expert, rank by rank over that rank's tokens in order; its dx stays fp32 until the
  // combine below.
  const int64_t shared_inter = shape_.shared_intermediate;
  for (int64_t rank = 0; rank < num_ranks(); ++rank) {
    const RankInputs& inputs = ranks_[rank];
    const int64_t tokens = num_tokens(rank);
    std::vector<Real> shared_dx(static_cast<size_t>(tokens * hidden), 0);
    if (shape_.has_shared()) {
      std::vector<Real> d_gate(tokens * shared_inter), d_up(tokens * shared_inter),
          hs(tokens * shared_inter);
      const ExpertWeights weights = shared_weights(rank);
      parallel_for(
          tokens, num_threads_,
          [&](int64_t token, int thread_idx) {
            Real* x = scratch[thread_idx].data();
            Real *dy = x + hidden, *gate = dy + hidden, *up = gate + shared_inter,
                 *gvec = up + shared_inter;
            load(token_row(inputs.tokens.x, token), hidden, x);
            load(token_row(inputs.dy, token), hidden, dy);
            Real* h = hs.data() + token * shared_inter;
            backward_hidden(weights, shared_inter, x, gate, up, h);
            down_dgrad(weights, shared_inter, dy, gvec);
            for (int64_t i = 0; i < shared_inter; ++i) {
              const auto grad = numerics::swiglu_backward(gate[i], up[i], gvec[i]);
              d_gate[token * shared_inter + i] = Store::store(grad.d_gate);
              d_up[token * shared_inter + i] = Store::store(grad.d_up);
            }
            input_dgrad(weights, shared_inter, d_gate.data() + token * shared_inter,
                        d_up.data() + token * shared_inter, shared_dx.data() + token * hidden);
          },
          "backward: shared expert", progress_);
      const GradTargets<Real>& target = grads[rank];
      parallel_for(shared_inter, num_threads_, [&](int64_t i, int) {
        Real* grad_gate = target.shared_gate + i * hidden;
        Real* grad_up = target.shared_up + i * hidden;
        for (int64_t token = 0; token < tokens; ++token) {
          const bf16* x = token_row(inputs.tokens.x, token);
          for (int64_t n = 0; n < hidden; ++n) {
            const Real x_value = x[n].to_float();
            grad_gate[n] = grad_gate[n] + d_gate[token * shared_inter + i] * x_value;
            grad_up[n] = grad_up[n] + d_up[token * shared_inter + i] * x_value;
          }
        }
      });
      parallel_for(hidden, num_threads_, [&](int64_t n, int) {
        Real* grad_down = target.shared_down + n * shared_inter;
        for (int64_t token = 0; token < tokens; ++token) {
          const Real dy = token_row(inputs.dy, token)[n].to_float();
          const Real* h = hs.data() + token * shared_inter;
          for (int64_t i = 0; i < shared_inter; ++i) grad_down[i] = grad_down[i] + dy * h[i];
        }
      });
    }

    results[rank].dx = combine_slots<Real, Store>(inputs.tokens, top_k, hidden, dx_slots[rank],
                                                  shared_dx, /*weighted=*/false, num_threads_);
  }
  return results;
}

template class LayerEngine<float>;
template class LayerEngine<double>;

}  // namespace mok::reference
