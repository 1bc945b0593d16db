// Shared test helpers: run the CPU backend on a synthetic problem, compare outputs bitwise or
// against an oracle.
#pragma once

#include <gtest/gtest.h>

#include <cstring>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "mok/compare.hpp"
#include "mok/precision.hpp"
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

// Forward + backward at `ep` ranks in `precision`.
inline ProblemOutputs run_layer(const Problem& problem, int64_t ep, Precision precision,
                                int num_threads = 0) {
  ProblemOutputs outputs = ProblemOutputs::poisoned(problem, ep);
  const std::vector<reference::RankInputs> ranks = problem.all_rank_inputs(ep);
  const std::vector<reference::RankOutputs> views = outputs.rank_outputs(problem);
  reference::Options options;
  options.num_threads = num_threads;
  options.precision = precision;
  reference::forward(problem.shape, ranks, views, options);
  reference::backward(problem.shape, ranks, views, GradMode::kOverwrite, options);
  return outputs;
}

// Every output of an EP 1 run (or of an oracle of a quantized recipe, fp64 values compared in
// fp64) against an oracle of the same problem, by name; the shared expert's only when it has one.
struct OutputErrors {
  std::vector<std::pair<std::string, ErrorStats>> entries;

  static OutputErrors of(const ProblemOutputs& out, const reference::OracleResult& oracle) {
    OutputErrors errors;
    errors.add("y", compare(std::span<const bf16>(out.y), oracle.y));
    errors.add("dx", compare(std::span<const bf16>(out.dx), oracle.dx));
    errors.add("d_topk_w", compare(std::span<const float>(out.d_topk_w), oracle.d_topk_w));
    errors.add("grad_gate", compare(std::span<const float>(out.grad_gate), oracle.grad_gate));
    errors.add("grad_up", compare(std::span<const float>(out.grad_up), oracle.grad_up));
    errors.add("grad_down", compare(std::span<const float>(out.grad_down), oracle.grad_down));
    if (!oracle.grad_shared_gate.empty()) {
      errors.add("grad_shared_gate",
                 compare(std::span<const float>(out.grad_shared_gate), oracle.grad_shared_gate));
      errors.add("grad_shared_up",
                 compare(std::span<const float>(out.grad_shared_up), oracle.grad_shared_up));
      errors.add("grad_shared_down",
                 compare(std::span<const float>(out.grad_shared_down), oracle.grad_shared_down));
    }
    return errors;
  }
  static OutputErrors of(const reference::OracleResult& value,
                         const reference::OracleResult& oracle) {
    OutputErrors errors;
    const auto add = [&](const char* name, const std::vector<double>& a,
                         const std::vector<double>& b) {
      if (!b.empty()) errors.add(name, compare(std::span<const double>(a), b));
    };
    add("y", value.y, oracle.y);
    add("dx", value.dx, oracle.dx);
    add("d_topk_w", value.d_topk_w, oracle.d_topk_w);
    add("grad_gate", value.grad_gate, oracle.grad_gate);
    add("grad_up", value.grad_up, oracle.grad_up);
    add("grad_down", value.grad_down, oracle.grad_down);
    add("grad_shared_gate", value.grad_shared_gate, oracle.grad_shared_gate);
    add("grad_shared_up", value.grad_shared_up, oracle.grad_shared_up);
    add("grad_shared_down", value.grad_shared_down, oracle.grad_shared_down);
    return errors;
  }

  void add(const std::string& name, const ErrorStats& stats) { entries.push_back({name, stats}); }
};

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
