// Shared test helpers: run the CPU backend on a synthetic problem, compare outputs bitwise.
#pragma once

#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "mok/synthetic.hpp"

namespace mok::testing {

inline LayerShape tiny_shape(bool shared = true) {
  return {/*hidden=*/64, /*intermediate=*/32, /*shared_intermediate=*/shared ? 48 : 0,
          /*num_experts=*/16, /*top_k=*/4};
}

// Forward + backward at `ep` ranks. In accumulate mode every gradient buffer starts from
// `initial_grad` (one value per element, repeated), standing in for a caller's main_grad.
inline ProblemOutputs run_layer(const Problem& problem, int64_t ep, int num_threads = 0,
                                GradMode mode = GradMode::kOverwrite,
                                const std::vector<float>* initial_grad = nullptr) {
  ProblemOutputs outputs = ProblemOutputs::poisoned(problem, ep);
  if (initial_grad) {
    for (std::vector<float>* grad :
         {&outputs.grad_gate, &outputs.grad_up, &outputs.grad_down, &outputs.grad_shared_gate,
          &outputs.grad_shared_up, &outputs.grad_shared_down}) {
      for (size_t index = 0; index < grad->size(); ++index) {
        (*grad)[index] = (*initial_grad)[index % initial_grad->size()];
      }
    }
  }
  const std::vector<reference::RankInputs> ranks = problem.all_rank_inputs(ep);
  const std::vector<reference::RankOutputs> views = outputs.rank_outputs(problem);
  reference::Options options;
  options.num_threads = num_threads;
  reference::forward(problem.shape, ranks, views, options);
  reference::backward(problem.shape, ranks, views, mode, options);
  return outputs;
}

template <class T>
::testing::AssertionResult bitwise_equal(const std::vector<T>& a, const std::vector<T>& b) {
  if (a.size() != b.size()) {
    return ::testing::AssertionFailure() << "sizes " << a.size() << " vs " << b.size();
  }
  for (size_t index = 0; index < a.size(); ++index) {
    if (std::memcmp(&a[index], &b[index], sizeof(T)) != 0) {
      return ::testing::AssertionFailure()
             << "first difference at element " << index << " of " << a.size() << ": "
             << static_cast<float>(a[index]) << " vs " << static_cast<float>(b[index]);
    }
  }
  return ::testing::AssertionSuccess();
}

// Every output of `outputs` still holds the poison ProblemOutputs::poisoned wrote: a refused call
// (bad input) must leave all of them as they were, not only y.
inline void expect_untouched(const Problem& problem, const ProblemOutputs& outputs) {
  const ProblemOutputs poison = ProblemOutputs::poisoned(problem, outputs.ep);
  EXPECT_TRUE(bitwise_equal(outputs.y, poison.y)) << "y was written";
  EXPECT_TRUE(bitwise_equal(outputs.dx, poison.dx)) << "dx was written";
  EXPECT_TRUE(bitwise_equal(outputs.d_topk_w, poison.d_topk_w)) << "d_topk_w was written";
  EXPECT_TRUE(bitwise_equal(outputs.grad_gate, poison.grad_gate)) << "grad_gate was written";
  EXPECT_TRUE(bitwise_equal(outputs.grad_up, poison.grad_up)) << "grad_up was written";
  EXPECT_TRUE(bitwise_equal(outputs.grad_down, poison.grad_down)) << "grad_down was written";
  EXPECT_TRUE(bitwise_equal(outputs.grad_shared_gate, poison.grad_shared_gate))
      << "grad_shared_gate was written";
  EXPECT_TRUE(bitwise_equal(outputs.grad_shared_up, poison.grad_shared_up))
      << "grad_shared_up was written";
  EXPECT_TRUE(bitwise_equal(outputs.grad_shared_down, poison.grad_shared_down))
      << "grad_shared_down was written";
}

// Every output that the EP contract covers: y, dx, d_topk_w, routed-expert weight gradients.
inline void expect_ep_invariant_outputs_equal(const ProblemOutputs& a, const ProblemOutputs& b) {
  EXPECT_TRUE(bitwise_equal(a.y, b.y)) << "y";
  EXPECT_TRUE(bitwise_equal(a.dx, b.dx)) << "dx";
  EXPECT_TRUE(bitwise_equal(a.d_topk_w, b.d_topk_w)) << "d_topk_w";
  EXPECT_TRUE(bitwise_equal(a.grad_gate, b.grad_gate)) << "grad_gate";
  EXPECT_TRUE(bitwise_equal(a.grad_up, b.grad_up)) << "grad_up";
  EXPECT_TRUE(bitwise_equal(a.grad_down, b.grad_down)) << "grad_down";
}

}  // namespace mok::testing
