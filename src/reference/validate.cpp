// Host-side argument checks shared by every backend.
#include <cmath>

#include "mok/layer.hpp"

namespace mok {

void validate_weights(const LayerShape& shape, int64_t ep, const LayerWeights& weights) {
  const int64_t local_experts = shape.num_experts / ep;
  const int64_t hidden = shape.hidden, inter = shape.intermediate;
  check_shape(weights.gate, "w_gate", {local_experts, inter, hidden});
  check_shape(weights.up, "w_up", {local_experts, inter, hidden});
  check_shape(weights.down, "w_down", {local_experts, hidden, inter});
  if (shape.has_shared()) {
    const int64_t shared = shape.shared_intermediate;
    check_shape(weights.shared_gate, "w_shared_gate", {shared, hidden});
    check_shape(weights.shared_up, "w_shared_up", {shared, hidden});
    check_shape(weights.shared_down, "w_shared_down", {hidden, shared});
  }
}

void validate_tokens(const LayerShape& shape, const TokenBatch& tokens) {
  MOK_CHECK_ARG(tokens.x.shape.size() == 2, "x", "expected a 2-D tensor (T, H), got shape ",
                format_shape(tokens.x.shape));
  const int64_t num_tokens = tokens.x.shape[0];
  MOK_CHECK_ARG(num_tokens > 0, "x", "T = ", num_tokens, " tokens; a layer call needs at least one");
  check_shape(tokens.x, "x", {num_tokens, shape.hidden});
  check_shape(tokens.topk_idx, "topk_idx", {num_tokens, shape.top_k});
  check_shape(tokens.topk_w, "topk_w", {num_tokens, shape.top_k});

  for (int64_t token = 0; token < num_tokens; ++token) {
    const int32_t* row = tokens.topk_idx.data + token * shape.top_k;
    for (int64_t slot = 0; slot < shape.top_k; ++slot) {
      const int32_t expert = row[slot];
      MOK_CHECK_ARG(expert >= -1 && expert < shape.num_experts, "topk_idx", "expert id ", expert,
                    " out of range [0, ", shape.num_experts, ") at token ", token, ", slot ", slot,
                    " (-1 marks an unused slot)");
      for (int64_t earlier = 0; expert >= 0 && earlier < slot; ++earlier) {
        MOK_CHECK_ARG(row[earlier] != expert, "topk_idx", "expert id ", expert,
                      " repeated at token ", token, " (slots ", earlier, " and ", slot, ")");
      }
      const float weight = tokens.topk_w.data[token * shape.top_k + slot];
      MOK_CHECK_ARG(std::isfinite(weight), "topk_w", "non-finite router weight ", weight,
                    " at token ", token, ", slot ", slot);
    }
  }
}

void validate_grads(const LayerShape& shape, int64_t ep, const WeightGrads& grads) {
  const int64_t local_experts = shape.num_experts / ep;
  const int64_t hidden = shape.hidden, inter = shape.intermediate;
  check_shape(grads.gate, "grad_gate", {local_experts, inter, hidden});
  check_shape(grads.up, "grad_up", {local_experts, inter, hidden});
  check_shape(grads.down, "grad_down", {local_experts, hidden, inter});
  if (shape.has_shared()) {
    const int64_t shared = shape.shared_intermediate;
    check_shape(grads.shared_gate, "grad_shared_gate", {shared, hidden});
    check_shape(grads.shared_up, "grad_shared_up", {shared, hidden});
    check_shape(grads.shared_down, "grad_shared_down", {hidden, shared});
  }
}

}  // namespace mok
