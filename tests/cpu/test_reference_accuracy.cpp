// The emulated (GPU rounding points) reference against the fp64 oracle.
#include <gtest/gtest.h>

#include "helpers.hpp"
#include "mok/compare.hpp"

namespace mok {
namespace {

struct AccuracyCase {
  const char* name;
  bool shared;
  const char* routing;
  bool signed_weights;
  double unused_slots;
};

class ReferenceAccuracy : public ::testing::TestWithParam<AccuracyCase> {};

TEST_P(ReferenceAccuracy, WithinBf16ToleranceOfOracle) {
  const AccuracyCase& param = GetParam();
  SyntheticSpec spec{testing::tiny_shape(param.shared),
                     96,
                     Routing::parse(param.routing),
                     7,
                     param.signed_weights,
                     param.unused_slots};
  const Problem problem = Problem::generate(spec);
  const ProblemOutputs outputs = testing::run_layer(problem, 2);
  const reference::OracleResult oracle =
      reference::oracle(problem.shape, problem.all_rank_inputs(1), true)[0];

  auto expect_close = [](const ErrorStats& stats, const char* name) {
    EXPECT_TRUE(stats.within(kBf16Tolerance)) << name << ": " << stats.describe();
    // Two or three bf16 roundings in a row: far under the tolerance, well over fp32 noise.
    EXPECT_GT(stats.relative_l2, 1e-5) << name << " is suspiciously exact: " << stats.describe();
  };
  expect_close(compare(std::span<const bf16>(outputs.y), oracle.y), "y");
  expect_close(compare(std::span<const bf16>(outputs.dx), oracle.dx), "dx");
  expect_close(compare(std::span<const float>(outputs.d_topk_w), oracle.d_topk_w), "d_topk_w");
  expect_close(compare(std::span<const float>(outputs.grad_gate), oracle.grad_gate), "grad_gate");
  expect_close(compare(std::span<const float>(outputs.grad_up), oracle.grad_up), "grad_up");
  expect_close(compare(std::span<const float>(outputs.grad_down), oracle.grad_down), "grad_down");
  if (param.shared) {
    // Shared-expert gradients are per rank; their sum over the two ranks is the layer's.
    for (auto [per_rank, whole, name] :
         {std::tuple{&outputs.grad_shared_gate, &oracle.grad_shared_gate, "grad_shared_gate"},
          std::tuple{&outputs.grad_shared_up, &oracle.grad_shared_up, "grad_shared_up"},
          std::tuple{&outputs.grad_shared_down, &oracle.grad_shared_down, "grad_shared_down"}}) {
      const size_t size = whole->size();
      std::vector<float> total(size);
      for (size_t index = 0; index < size; ++index)
        total[index] = (*per_rank)[index] + (*per_rank)[size + index];
      expect_close(compare(std::span<const float>(total), *whole), name);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Routings, ReferenceAccuracy,
    ::testing::Values(AccuracyCase{"uniform_shared", true, "uniform", false, 0.0},
                      AccuracyCase{"uniform_no_shared", false, "uniform", false, 0.0},
                      AccuracyCase{"skewed_signed_weights", true, "skewed:1.5", true, 0.0},
                      AccuracyCase{"unused_slots", true, "uniform", true, 0.3}),
    [](const auto& info) { return std::string(info.param.name); });

TEST(ReferenceAccuracy, UnusedSlotsGiveZeroRouterGradient) {
  SyntheticSpec spec{testing::tiny_shape(), 64, Routing::parse("uniform"), 3, false, 0.4};
  const Problem problem = Problem::generate(spec);
  const ProblemOutputs outputs = testing::run_layer(problem, 1);
  int64_t unused = 0;
  for (size_t index = 0; index < problem.topk_idx.size(); ++index) {
    if (problem.topk_idx[index] >= 0) continue;
    ++unused;
    EXPECT_EQ(outputs.d_topk_w[index], 0.0f) << "slot " << index;
  }
  EXPECT_GT(unused, 0);
}

TEST(ReferenceAccuracy, TokenWithNoExpertGetsSharedExpertOnly) {
  // Every slot unused: y is the shared expert alone and dx its input gradient alone.
  SyntheticSpec spec{testing::tiny_shape(), 16, Routing::parse("uniform"), 5, false, 1.0};
  const Problem problem = Problem::generate(spec);
  const ProblemOutputs outputs = testing::run_layer(problem, 1);
  const reference::OracleResult oracle =
      reference::oracle(problem.shape, problem.all_rank_inputs(1), true)[0];
  EXPECT_TRUE(compare(std::span<const bf16>(outputs.y), oracle.y).within(kBf16Tolerance));
  EXPECT_TRUE(compare(std::span<const bf16>(outputs.dx), oracle.dx).within(kBf16Tolerance));
  for (float grad : outputs.grad_gate) EXPECT_EQ(grad, 0.0f);
}

}  // namespace
}  // namespace mok
