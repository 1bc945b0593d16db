// What one expert-parallel rank holds and produces for one MoE layer (DESIGN.md §1).
// Rank r of R holds its T tokens and the E/R routed experts r*E/R .. (r+1)*E/R - 1.
// Weight layout is [.., out, in], K-contiguous.
#pragma once

#include <cstdint>

#include "mok/bf16.hpp"
#include "mok/shape.hpp"
#include "mok/tensor.hpp"

namespace mok {

struct LayerWeights {
  View<const bf16> gate;         // (E_local, I, H)
  View<const bf16> up;           // (E_local, I, H)
  View<const bf16> down;         // (E_local, H, I)
  View<const bf16> shared_gate;  // (I_s, H); empty when there is no shared expert
  View<const bf16> shared_up;    // (I_s, H)
  View<const bf16> shared_down;  // (H, I_s)
};

struct TokenBatch {
  View<const bf16> x;            // (T, H)
  View<const int32_t> topk_idx;  // (T, k) global expert ids, distinct within a row, -1 = unused
  View<const float> topk_w;      // (T, k) router weights, any sign, finite
};

// fp32 weight gradients, the same shapes as LayerWeights. In accumulate mode they are the caller's
// main_grad buffers and the gradient is added to what they hold: each K-loop starts from the
// stored value (an fp32 load is exact), so accumulating is deterministic too.
struct WeightGrads {
  View<float> gate, up, down;
  View<float> shared_gate, shared_up, shared_down;
};

enum class GradMode { kOverwrite, kAccumulate };

// Host-side checks of one rank's arguments; each throws mok::Error naming the argument.
void validate_weights(const LayerShape& shape, int64_t ep, const LayerWeights& weights);
void validate_tokens(const LayerShape& shape, const TokenBatch& tokens);
void validate_grads(const LayerShape& shape, int64_t ep, const WeightGrads& grads);

}  // namespace mok
