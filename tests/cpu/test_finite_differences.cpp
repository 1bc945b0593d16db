// The backward formulas against finite differences of the forward, both in fp64 (the oracle),
// on a layer small enough to perturb element by element. The loss is L = <dy, y>, so dL/dθ is
// exactly what backward returns for every parameter θ.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>

#include "helpers.hpp"

namespace mok {
namespace {

double loss(const Problem& problem) {
  const std::vector<double> y =
      reference::oracle(problem.shape, problem.all_rank_inputs(1), false)[0].y;
  double sum = 0;
  for (size_t index = 0; index < y.size(); ++index) sum += problem.dy[index].to_float() * y[index];
  return sum;
}

// Central differences at steps h and h/2, Richardson-extrapolated (error O(h^4)). `set` writes
// base + offset into the perturbed element; every value it writes is exact in its storage type.
double numeric_gradient(Problem problem, const std::function<void(Problem&, double)>& set,
                        double step) {
  auto central = [&](double h) {
    set(problem, h);
    const double plus = loss(problem);
    set(problem, -h);
    const double minus = loss(problem);
    set(problem, 0);
    return (plus - minus) / (2 * h);
  };
  return (4 * central(step / 2) - central(step)) / 3;
}

class FiniteDifferences : public ::testing::Test {
 protected:
  void SetUp() override {
    const LayerShape shape{/*hidden=*/16, /*intermediate=*/8, /*shared=*/8, /*experts=*/4,
                           /*top_k=*/2};
    problem_ = Problem::generate({shape, 6, Routing::parse("uniform"), 13, /*signed=*/true});
    expert_ = problem_.topk_idx[0];  // token 0's first expert: it has at least one row
  }

  // Sets element `index` of a bf16 tensor to 0.75 (exact), so that 0.75 ± 2^-6 and ± 2^-7 are
  // exact too; returns the analytic gradient there.
  void check_bf16(std::vector<bf16> Problem::*tensor, size_t index, const char* name,
                  const std::function<double(const reference::OracleResult&)>& analytic) {
    (problem_.*tensor)[index] = bf16(0.75f);
    const reference::OracleResult result =
        reference::oracle(problem_.shape, problem_.all_rank_inputs(1), true)[0];
    const double expected = analytic(result);
    const double numeric = numeric_gradient(
        problem_,
        [&](Problem& p, double offset) {
          (p.*tensor)[index] = bf16(static_cast<float>(0.75 + offset));
        },
        0x1.0p-6);
    EXPECT_NEAR(numeric, expected, 1e-5 * (1 + std::fabs(expected))) << name << "[" << index << "]";
  }

  Problem problem_;
  int32_t expert_ = 0;
};

TEST_F(FiniteDifferences, InputGradient) {
  const int64_t hidden = problem_.shape.hidden;
  for (size_t index : {size_t{0}, size_t{5}, static_cast<size_t>(3 * hidden + 7)}) {
    check_bf16(&Problem::x, index, "x", [&](const auto& r) { return r.dx[index]; });
  }
}

TEST_F(FiniteDifferences, RoutedWeightGradients) {
  const size_t matrix = problem_.shape.intermediate * problem_.shape.hidden;
  for (size_t offset : {size_t{1}, size_t{37}, matrix - 2}) {
    const size_t index = expert_ * matrix + offset;
    check_bf16(&Problem::gate, index, "w_gate", [&](const auto& r) { return r.grad_gate[index]; });
    check_bf16(&Problem::up, index, "w_up", [&](const auto& r) { return r.grad_up[index]; });
    check_bf16(&Problem::down, index, "w_down", [&](const auto& r) { return r.grad_down[index]; });
  }
}

TEST_F(FiniteDifferences, SharedWeightGradients) {
  for (size_t index : {size_t{0}, size_t{50}, size_t{127}}) {
    check_bf16(&Problem::shared_gate, index, "w_shared_gate",
               [&](const auto& r) { return r.grad_shared_gate[index]; });
    check_bf16(&Problem::shared_up, index, "w_shared_up",
               [&](const auto& r) { return r.grad_shared_up[index]; });
    check_bf16(&Problem::shared_down, index, "w_shared_down",
               [&](const auto& r) { return r.grad_shared_down[index]; });
  }
}

TEST_F(FiniteDifferences, RouterWeightGradient) {
  const reference::OracleResult result =
      reference::oracle(problem_.shape, problem_.all_rank_inputs(1), true)[0];
  for (size_t index : {size_t{0}, size_t{3}, size_t{9}}) {
    const float base = problem_.topk_w[index];
    const double numeric = numeric_gradient(
        problem_,
        [&](Problem& p, double offset) {
          p.topk_w[index] = static_cast<float>(base + offset);  // base ± 2^-8, 2^-9: exact in fp32
        },
        0x1.0p-8);
    EXPECT_NEAR(numeric, result.d_topk_w[index], 1e-6 * (1 + std::fabs(numeric)))
        << "topk_w[" << index << "]";
    EXPECT_NE(result.d_topk_w[index], 0.0);
  }
}

}  // namespace
}  // namespace mok
