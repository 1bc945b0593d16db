// Host-side argument checks shared by every backend.
#include <cmath>
#include <string>

#include "mok/layer.hpp"

namespace mok {

namespace {

// The six expert tensors of a rank, weights ("w_") or their gradients ("grad_"), have the same
// shapes: routed (E_local, I, H), (E_local, I, H), (E_local, H, I); shared (I_s, H), (I_s, H),
// (H, I_s) when there is a shared expert.
template <class T>
void check_expert_shapes(const LayerShape& shape, int64_t ep, const std::string& prefix,
                         const View<T>& gate, const View<T>& up, const View<T>& down,
                         const View<T>& shared_gate, const View<T>& shared_up,
                         const View<T>& shared_down) {
  const int64_t local_experts = shape.num_experts / ep;
  const int64_t hidden = shape.hidden, inter = shape.intermediate;
  check_shape(gate, (prefix + "gate").c_str(), {local_experts, inter, hidden});
  check_shape(up, (prefix + "up").c_str(), {local_experts, inter, hidden});
  check_shape(down, (prefix + "down").c_str(), {local_experts, hidden, inter});
  if (shape.has_shared()) {
    const int64_t shared = shape.shared_intermediate;
    check_shape(shared_gate, (prefix + "shared_gate").c_str(), {shared, hidden});
    check_shape(shared_up, (prefix + "shared_up").c_str(), {shared, hidden});
    check_shape(shared_down, (prefix + "shared_down").c_str(), {hidden, shared});
  }
}

}  // namespace

void validate_weights(const LayerShape& shape, int64_t ep, const LayerWeights& weights) {
  check_expert_shapes(shape, ep, "w_", weights.gate, weights.up, weights.down, weights.shared_gate,
                      weights.shared_up, weights.shared_down);
}

void validate_tokens(const LayerShape& shape, const TokenBatch& tokens) {
  MOK_CHECK_ARG(tokens.x.shape.size() == 2, "x", "expected a 2-D tensor (T, H), got shape ",
                format_shape(tokens.x.shape));
  const int64_t num_tokens = tokens.x.shape[0];
  MOK_CHECK_ARG(num_tokens > 0, "x", "T = ", num_tokens,
                " tokens; a layer call needs at least one");
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
      // The ids of a row are distinct (each expert adds a token's row once); -1 may repeat.
      for (int64_t earlier = 0; expert >= 0 && earlier < slot; ++earlier) {
        MOK_CHECK_ARG(row[earlier] != expert, "topk_idx", "expert id ", expert,
                      " repeated at token ", token, ", slot ", slot, " (also at slot ", earlier,
                      "; the ids of a row must be distinct, only -1 may repeat)");
      }
      const float weight = tokens.topk_w.data[token * shape.top_k + slot];
      MOK_CHECK_ARG(std::isfinite(weight), "topk_w", "non-finite router weight ", weight,
                    " at token ", token, ", slot ", slot);
    }
  }
}

void validate_grads(const LayerShape& shape, int64_t ep, const WeightGrads& grads) {
  check_expert_shapes(shape, ep, "grad_", grads.gate, grads.up, grads.down, grads.shared_gate,
                      grads.shared_up, grads.shared_down);
}

}  // namespace mok
