// The bounds of the CLI's --check on small runs (mok/compare.hpp: bf16_tolerance,
// fp8_yardstick_margin, kFp8JudgedTokens): random small layers of 1 to 64 tokens in all three
// precisions stay within them (the fixed bounds of the tests, which hold from 256 tokens, failed
// about one in twenty such runs), they narrow to the fixed bounds on large runs, and an FP8 run
// that skipped its quantization still fails from kFp8JudgedTokens tokens on.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "helpers.hpp"
#include "mok/compare.hpp"

namespace mok {
namespace {

using testing::OutputErrors;
using testing::run_layer;

// Each output's rel-L2 of the yardstick: the same quantized operands, all else in fp64.
std::vector<double> yardstick_of(const Problem& problem, Precision precision,
                                 const reference::OracleResult& exact) {
  reference::Options options;
  options.precision = precision;
  const OutputErrors errors = OutputErrors::of(
      reference::oracle(problem.shape, problem.all_rank_inputs(1), true, options)[0], exact);
  std::vector<double> relative_l2;
  for (const auto& [name, stats] : errors.entries) relative_l2.push_back(stats.relative_l2);
  return relative_l2;
}

struct SmallRun {
  Precision precision;
  Problem problem;
};

// A small random layer: H, I, I_s a few of the precision's blocks, 1 to 4 experts, 1 to 64 tokens.
SmallRun small_run(uint32_t seed) {
  std::mt19937 random(seed);
  const auto pick = [&](int count) { return static_cast<int>(random() % count); };
  const Precision precision =
      std::vector<Precision>{Precision::kBf16, Precision::kFp8, Precision::kMxfp8}[seed % 3];
  const int64_t block = precision == Precision::kFp8     ? 128
                        : precision == Precision::kMxfp8 ? 32
                                                         : 8;
  LayerShape shape;
  shape.hidden = block * (1 + pick(3));
  shape.intermediate = block * (1 + pick(3));
  shape.shared_intermediate = block * pick(3);
  shape.num_experts = 1 + pick(4);
  shape.top_k = 1 + pick(static_cast<int>(shape.num_experts));
  const int64_t tokens = std::vector<int64_t>{1, 2, 3, 4, 8, 16, 32, 64}[pick(8)];
  const char* routing = std::vector<const char*>{"uniform", "skewed:1.5", "single-expert"}[pick(3)];
  return {precision, Problem::generate({shape, tokens, Routing::parse(routing), seed})};
}

TEST(CheckBounds, SmallRandomLayersStayWithinThem) {
  int judged = 0;
  for (uint32_t seed = 1; seed <= 60; ++seed) {
    const SmallRun run = small_run(seed);
    const int64_t tokens = run.problem.num_tokens;
    SCOPED_TRACE(std::string(precision_name(run.precision)) + ", seed " + std::to_string(seed) +
                 ", " + std::to_string(tokens) + " tokens");
    const reference::OracleResult exact =
        reference::oracle(run.problem.shape, run.problem.all_rank_inputs(1), true)[0];
    const auto errors = OutputErrors::of(run_layer(run.problem, 1, run.precision), exact).entries;
    if (run.precision == Precision::kBf16) {
      for (const auto& [name, stats] : errors) {
        EXPECT_TRUE(stats.within(bf16_tolerance(tokens))) << name << ": " << stats.describe();
      }
      continue;
    }
    const std::vector<double> yardstick = yardstick_of(run.problem, run.precision, exact);
    ASSERT_EQ(yardstick.size(), errors.size());
    for (size_t index = 0; index < errors.size(); ++index) {
      const auto& [name, stats] = errors[index];
      EXPECT_EQ(stats.non_finite, 0) << name;
      if (tokens < kFp8JudgedTokens) continue;
      ++judged;
      EXPECT_LE(std::fabs(stats.relative_l2 - yardstick[index]),
                fp8_yardstick_margin(tokens) * yardstick[index])
          << name << ": " << stats.describe() << "; yardstick " << yardstick[index];
    }
  }
  EXPECT_GT(judged, 20) << "too few FP8 outputs judged for the test to mean anything";
}

TEST(CheckBounds, NarrowToTheFixedBoundsOnLargeRuns) {
  EXPECT_LT(bf16_tolerance(65536), 1.03 * kBf16Tolerance);
  EXPECT_LT(fp8_yardstick_margin(65536), kFp8YardstickTolerance + 0.002);
  // Where FP8 errors are judged, a quantization point skipped, added or scaled wrongly (a quarter
  // of the yardstick or more, test_reference_fp8.cpp) still fails; bf16 errors of a wrong formula
  // (order 1) fail at any size.
  EXPECT_LT(fp8_yardstick_margin(kFp8JudgedTokens), 0.25);
  EXPECT_LT(bf16_tolerance(1), 0.1);
  EXPECT_GT(bf16_tolerance(1), bf16_tolerance(2));
}

TEST(CheckBounds, AnFp8RunWithoutItsQuantizationStillFails) {
  // The bf16 layer judged as an fp8 run: every quantization point skipped.
  LayerShape shape;
  shape.hidden = 128;
  shape.intermediate = 128;
  shape.shared_intermediate = 128;
  shape.num_experts = 2;
  shape.top_k = 1;
  const Problem problem =
      Problem::generate({shape, kFp8JudgedTokens, Routing::parse("uniform"), 5});
  const reference::OracleResult exact =
      reference::oracle(problem.shape, problem.all_rank_inputs(1), true)[0];
  const auto errors = OutputErrors::of(run_layer(problem, 1, Precision::kBf16), exact).entries;
  const std::vector<double> yardstick = yardstick_of(problem, Precision::kFp8, exact);
  for (size_t index = 0; index < errors.size(); ++index) {
    EXPECT_GT(std::fabs(errors[index].second.relative_l2 - yardstick[index]),
              fp8_yardstick_margin(kFp8JudgedTokens) * yardstick[index])
        << errors[index].first;
  }
}

}  // namespace
}  // namespace mok
