// The combine of both CPU engines (DESIGN.md §1): each token's k combine slots summed in j order in
// fp32 (unused slots skipped), the shared expert's unrounded output added last, then stored once.
// The same for every precision mode: the expert output rows are bf16 in their slots either way.
#pragma once

#include <cstdint>
#include <vector>

#include "mok/layer.hpp"
#include "reference/parallel.hpp"

namespace mok::reference {

// out (T, H) = store(sum_j weight_tj * slot_tj + shared_t): weight_tj is topk_w (the forward's y)
// or 1, not multiplied at all (the backward's dx). slots (T, k, H), shared (T, H).
template <class Real, class Store>
std::vector<Real> combine_slots(const TokenBatch& tokens, int64_t top_k, int64_t hidden,
                                const std::vector<Real>& slots, const std::vector<Real>& shared,
                                bool weighted, int num_threads) {
  const int64_t num_tokens = tokens.x.shape[0];
  std::vector<Real> out(static_cast<size_t>(num_tokens * hidden));
  parallel_for(num_tokens, num_threads, [&](int64_t token, int) {
    for (int64_t n = 0; n < hidden; ++n) {
      Real sum = 0;
      for (int64_t slot = 0; slot < top_k; ++slot) {
        if (tokens.topk_idx.data[token * top_k + slot] < 0) continue;
        const Real value = slots[(token * top_k + slot) * hidden + n];
        if (weighted) {
          const Real weight = tokens.topk_w.data[token * top_k + slot];
          sum = sum + weight * value;
        } else {
          sum = sum + value;
        }
      }
      sum = sum + shared[token * hidden + n];
      out[token * hidden + n] = Store::store(sum);
    }
  });
  return out;
}

}  // namespace mok::reference
