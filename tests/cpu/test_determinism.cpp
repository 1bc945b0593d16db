// The determinism contract on the CPU backend: repeat, thread count and EP degree change no bit.
#include <gtest/gtest.h>

#include <cmath>

#include "helpers.hpp"

namespace mok {
namespace {

struct RoutingCase {
  const char* name;
  const char* routing;
  bool signed_weights;
  double unused_slots;
};

class EpInvariance : public ::testing::TestWithParam<RoutingCase> {};

TEST_P(EpInvariance, BitwiseEqualForOneTwoFourEightRanks) {
  const RoutingCase& param = GetParam();
  SyntheticSpec spec{testing::tiny_shape(),         128,
                     Routing::parse(param.routing), 11,
                     param.signed_weights,          param.unused_slots};
  const Problem problem = Problem::generate(spec);
  const ProblemOutputs single = testing::run_layer(problem, 1);
  for (int64_t ep : {2, 4, 8}) {
    SCOPED_TRACE("ep " + std::to_string(ep));
    testing::expect_ep_invariant_outputs_equal(single, testing::run_layer(problem, ep));
  }
}

INSTANTIATE_TEST_SUITE_P(Routings, EpInvariance,
                         ::testing::Values(RoutingCase{"uniform", "uniform", false, 0.0},
                                           RoutingCase{"skewed", "skewed:2", true, 0.0},
                                           RoutingCase{"all_tokens_to_one_expert", "single-expert",
                                                       false, 0.0},
                                           RoutingCase{"unused_slots", "uniform", true, 0.25}),
                         [](const auto& info) { return std::string(info.param.name); });

TEST(EpInvariance, EmptyExpertsHaveZeroGradients) {
  SyntheticSpec spec{testing::tiny_shape(), 64, Routing::parse("single-expert"), 2};
  const Problem problem = Problem::generate(spec);
  const ProblemOutputs outputs = testing::run_layer(problem, 4);
  const size_t matrix = problem.shape.intermediate * problem.shape.hidden;
  bool expert0_nonzero = false;
  for (size_t index = 0; index < outputs.grad_gate.size(); ++index) {
    if (index < matrix) {
      expert0_nonzero |= outputs.grad_gate[index] != 0.0f;
    } else {
      ASSERT_EQ(outputs.grad_gate[index], 0.0f) << "expert " << index / matrix << " has no rows";
      ASSERT_EQ(outputs.grad_down[index], 0.0f);
    }
  }
  EXPECT_TRUE(expert0_nonzero);
}

TEST(EpInvariance, AccumulateModeIsInvariantAndAddsToMainGrad) {
  SyntheticSpec spec{testing::tiny_shape(), 64, Routing::parse("skewed:1"), 4};
  const Problem problem = Problem::generate(spec);
  const std::vector<float> main_grad = {0.5f, -0.25f, 0.125f, 1.0f, -2.0f};
  const ProblemOutputs single =
      testing::run_layer(problem, 1, 0, GradMode::kAccumulate, &main_grad);
  const ProblemOutputs fresh = testing::run_layer(problem, 1);
  for (int64_t ep : {2, 8}) {
    testing::expect_ep_invariant_outputs_equal(
        single, testing::run_layer(problem, ep, 0, GradMode::kAccumulate, &main_grad));
  }
  for (size_t index = 0; index < fresh.grad_up.size(); ++index) {
    const float expected = fresh.grad_up[index] + main_grad[index % main_grad.size()];
    ASSERT_NEAR(single.grad_up[index], expected, 1e-5f * (1 + std::fabs(expected))) << index;
  }
}

TEST(Determinism, RepeatedRunsAreBitwiseEqual) {
  SyntheticSpec spec{testing::tiny_shape(), 96, Routing::parse("uniform"), 21};
  const Problem problem = Problem::generate(spec);
  const ProblemOutputs first = testing::run_layer(problem, 2);
  const ProblemOutputs second = testing::run_layer(problem, 2);
  testing::expect_ep_invariant_outputs_equal(first, second);
  EXPECT_TRUE(testing::bitwise_equal(first.grad_shared_gate, second.grad_shared_gate));
  EXPECT_EQ(checksum(first), checksum(second));
}

TEST(Determinism, ThreadCountChangesNothing) {
  SyntheticSpec spec{testing::tiny_shape(), 96, Routing::parse("skewed:1.2"), 8, true, 0.1};
  const Problem problem = Problem::generate(spec);
  const ProblemOutputs one = testing::run_layer(problem, 2, 1);
  for (int threads : {2, 3, 7}) {
    SCOPED_TRACE("threads " + std::to_string(threads));
    const ProblemOutputs many = testing::run_layer(problem, 2, threads);
    testing::expect_ep_invariant_outputs_equal(one, many);
    EXPECT_TRUE(testing::bitwise_equal(one.grad_shared_down, many.grad_shared_down));
  }
}

TEST(Determinism, DifferentSeedsGiveDifferentResults) {
  // Guards the tests above against comparing constants.
  const LayerShape shape = testing::tiny_shape();
  const ProblemOutputs a = testing::run_layer(Problem::generate({shape, 32, {}, 1}), 1);
  const ProblemOutputs b = testing::run_layer(Problem::generate({shape, 32, {}, 2}), 1);
  EXPECT_NE(checksum(a), checksum(b));
}

}  // namespace
}  // namespace mok
