// The CPU reference in the FP8 precision modes (fp8: DeepSeek-V3 blockwise, mxfp8: OCP MX):
// determinism (repeats, threads, emulated EP 1-8, bitwise), the quantizers' bytes inside the
// layer, and accuracy against the fp64 oracle measured by the yardstick FlashAttention's rule
// asks for: the same recipe computed from the same quantized operands in fp64.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <iostream>
#include <string>

#include "helpers.hpp"
#include "mok/compare.hpp"
#include "mok/quantize.hpp"
#include "reference/run.hpp"

namespace mok {
namespace {

using reference::QuantRecipe;
using testing::OutputErrors;
using testing::run_layer;

// Small enough for two cores: H 256 (two fp8 K blocks, eight mxfp8 ones), I 128, E 8.
LayerShape fp8_shape(int64_t top_k = 4, bool shared = true) {
  return {/*hidden=*/256, /*intermediate=*/128, /*shared_intermediate=*/shared ? 128 : 0,
          /*num_experts=*/8, /*top_k=*/top_k};
}

// Forward + backward through an internal recipe (testing::run_layer takes a public precision).
ProblemOutputs run_recipe(const Problem& problem, const QuantRecipe& recipe) {
  ProblemOutputs outputs = ProblemOutputs::poisoned(problem, 1);
  const std::vector<reference::RankInputs> ranks = problem.all_rank_inputs(1);
  const std::vector<reference::RankOutputs> views = outputs.rank_outputs(problem);
  reference::run_forward(problem.shape, ranks, views, {}, &recipe);
  reference::run_backward(problem.shape, ranks, views, GradMode::kOverwrite, {}, &recipe);
  return outputs;
}

// ---- the quantized operands are mok::quantize's
// ---------------------------------------------------

class Fp8Reference : public ::testing::TestWithParam<Precision> {};

TEST_P(Fp8Reference, QuantizedXIsTheQuantizersBytes) {
  const Precision precision = GetParam();
  const Problem problem = Problem::generate({fp8_shape(), 96, Routing::parse("uniform"), 31});
  const std::vector<reference::RankInputs> ranks = problem.all_rank_inputs(2);
  const QuantRecipe recipe = QuantRecipe::of(precision);
  const reference::QuantizedEngine<float> engine(problem.shape, ranks, {}, recipe);
  const int64_t block = precision_block(precision), hidden = problem.shape.hidden;
  for (int64_t rank = 0; rank < 2; ++rank) {
    const quantize::Layout layout =
        quantize::describe(recipe.format, 1, 48, hidden, 1, static_cast<int32_t>(block), false);
    std::vector<uint8_t> data(layout.num_elements()), scales(layout.scale_bytes());
    quantize::quantize_cpu(layout, ranks[rank].tokens.x.data, quantize::InputType::kBf16,
                           data.data(), scales.data());
    const reference::QuantizedMatrix& x = engine.quantized_x(rank);
    EXPECT_EQ(x.codes, data) << "rank " << rank;
    if (recipe.format == quantize::Format::kFp8) {
      ASSERT_EQ(x.scales.size() * 4, scales.size());
      EXPECT_EQ(std::memcmp(x.scales.data(), scales.data(), scales.size()), 0);
    } else {
      EXPECT_EQ(x.scale_codes, scales);
    }
  }
}

// The engine's own quantizer against mok::quantize for the weights' and the wgrad operands'
// layouts: 128 x 128 with a partial last row block, and the transposed (block x 1) copies.
TEST_P(Fp8Reference, BlockQuantizerMatchesQuantizeCpu) {
  const Precision precision = GetParam();
  const QuantRecipe recipe = QuantRecipe::of(precision);
  const int64_t rows = 200, cols = 256;  // 200: a partial 128-row block
  const Problem problem = Problem::generate({fp8_shape(), 1, Routing::parse("uniform"), 5});
  std::vector<float> values(rows * cols);
  for (int64_t index = 0; index < rows * cols; ++index) {
    values[index] = problem.gate[index].to_float() * static_cast<float>(1 + index % 7);
  }
  const auto expect_same = [&](const reference::QuantizedMatrix& ours,
                               const quantize::Layout& layout, const float* input) {
    std::vector<uint8_t> data(layout.num_elements()), scales(layout.scale_bytes());
    quantize::quantize_cpu(layout, input, quantize::InputType::kFp32, data.data(), scales.data());
    EXPECT_EQ(ours.codes, data);
    if (recipe.format == quantize::Format::kFp8) {
      ASSERT_EQ(ours.scales.size() * 4, scales.size());
      EXPECT_EQ(std::memcmp(ours.scales.data(), scales.data(), scales.size()), 0);
    } else {
      EXPECT_EQ(ours.scale_codes, scales);
    }
  };
  const int32_t block = static_cast<int32_t>(recipe.block);
  expect_same(reference::quantize_matrix(recipe.weights(), values.data(), rows, cols),
              quantize::describe(recipe.format, 1, rows, cols,
                                 static_cast<int32_t>(recipe.weight_rows), block, false),
              values.data());
  // Along the tokens: our operand is the transpose (cols, 128 rows) quantized 1 x block.
  const int64_t tokens = 128;
  std::vector<float> transposed(cols * tokens);
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t c = 0; c < cols; ++c) transposed[c * tokens + t] = values[t * cols + c];
  }
  expect_same(reference::quantize_matrix(recipe.activations(), transposed.data(), cols, tokens),
              quantize::describe(recipe.format, 1, tokens, cols, 1, block, true), values.data());
}

// ---- determinism
// ------------------------------------------------------------------------------------

TEST_P(Fp8Reference, RepeatsAndThreadCountsAreBitwiseEqual) {
  const Problem problem =
      Problem::generate({fp8_shape(), 192, Routing::parse("skewed:1.2"), 41, true, 0.1});
  const ProblemOutputs first = run_layer(problem, 2, GetParam(), 1);
  for (int threads : {1, 3}) {
    SCOPED_TRACE("threads " + std::to_string(threads));
    const ProblemOutputs again = run_layer(problem, 2, GetParam(), threads);
    testing::expect_ep_invariant_outputs_equal(first, again);
    EXPECT_TRUE(testing::bitwise_equal(first.grad_shared_gate, again.grad_shared_gate));
    EXPECT_TRUE(testing::bitwise_equal(first.grad_shared_down, again.grad_shared_down));
    EXPECT_EQ(checksum(first), checksum(again));
  }
}

struct RoutingCase {
  const char* name;
  const char* routing;
  int64_t top_k;
  bool signed_weights;
  double unused_slots;
};

class Fp8EpInvariance : public ::testing::TestWithParam<std::tuple<Precision, RoutingCase>> {};

TEST_P(Fp8EpInvariance, BitwiseEqualForOneTwoFourEightRanks) {
  const auto& [precision, param] = GetParam();
  // 272 tokens: the single expert's rows fill two 128-row token blocks and part of a third, and
  // at EP 8 each rank's 34 tokens straddle those blocks.
  const Problem problem =
      Problem::generate({fp8_shape(param.top_k), 272, Routing::parse(param.routing), 13,
                         param.signed_weights, param.unused_slots});
  const ProblemOutputs single = run_layer(problem, 1, precision);
  for (int64_t ep : {2, 4, 8}) {
    SCOPED_TRACE("ep " + std::to_string(ep));
    testing::expect_ep_invariant_outputs_equal(single, run_layer(problem, ep, precision));
  }
}

INSTANTIATE_TEST_SUITE_P(
    Routings, Fp8EpInvariance,
    ::testing::Combine(::testing::Values(Precision::kFp8, Precision::kMxfp8),
                       ::testing::Values(RoutingCase{"uniform", "uniform", 2, false, 0.0},
                                         RoutingCase{"skewed_signed", "skewed:2", 4, true, 0.0},
                                         RoutingCase{"single_expert", "single-expert", 3, false,
                                                     0.0},
                                         RoutingCase{"unused_slots", "uniform", 4, true, 0.25})),
    [](const auto& info) {
      return std::string(precision_name(std::get<0>(info.param))) + "_" +
             std::get<1>(info.param).name;
    });

// ---- accuracy
// -----------------------------------------------------------------------------------------

struct AccuracyCase {
  const char* name;
  const char* routing;
  bool signed_weights;
  double unused_slots;
};

class Fp8Accuracy : public ::testing::TestWithParam<std::tuple<Precision, AccuracyCase>> {};

TEST_P(Fp8Accuracy, WithinTheRecipesOwnErrorOfTheOracle) {
  const auto& [precision, param] = GetParam();
  const Problem problem = Problem::generate({fp8_shape(), 256, Routing::parse(param.routing), 17,
                                             param.signed_weights, param.unused_slots});
  const std::vector<reference::RankInputs> ranks = problem.all_rank_inputs(1);
  const reference::OracleResult exact = reference::oracle(problem.shape, ranks, true)[0];
  reference::Options quantized;
  quantized.precision = precision;
  const reference::OracleResult recipe =
      reference::oracle(problem.shape, ranks, true, quantized)[0];
  const OutputErrors emulated = OutputErrors::of(run_layer(problem, 1, precision), exact);
  const OutputErrors yardstick = OutputErrors::of(recipe, exact);
  // The bound. The emulation differs from the yardstick only by the bf16 stores of the bf16 path
  // (pre-activations, expert output rows, y, dx: each within 2^-9 relative, independent of the
  // quantization errors, so they add in quadrature: under 0.2 % of an error of 6 %), fp32 sums,
  // and the E4M3 rounding of values those moved (a different rounding of the same size). So both
  // errors agree within 5 %: a quantization point skipped, added or scaled wrongly moves them
  // apart by far more (one E4M3 rounding is a quarter to a half of the error). The yardstick
  // itself: one E4M3 rounding is within 2^-4 relative, and no output depends on more than six
  // rounded operands in a chain (x, W_gate / W_up, h, W_down; dy; d_gate / d_up), so at most
  // sqrt(6) * 2^-4 in the L2 sense.
  const double recipe_bound = std::sqrt(6.0) * 0x1p-4;
  for (size_t index = 0; index < emulated.entries.size(); ++index) {
    const auto& [name, stats] = emulated.entries[index];
    const double yardstick_error = yardstick.entries[index].second.relative_l2;
    std::cout << "  " << precision_name(precision) << " " << param.name << " " << name
              << ": rel-L2 " << stats.relative_l2 << " (quantize-then-fp64 " << yardstick_error
              << ")\n";
    EXPECT_EQ(stats.non_finite, 0) << name;
    EXPECT_LE(std::fabs(stats.relative_l2 - yardstick_error),
              kFp8YardstickTolerance * yardstick_error)
        << name << ": " << stats.describe() << "; quantize-then-fp64 " << yardstick_error;
    EXPECT_LE(yardstick_error, recipe_bound) << name;
    EXPECT_GT(yardstick_error, 0x1p-7) << name << ": no quantization error at all?";
  }
}

INSTANTIATE_TEST_SUITE_P(
    Routings, Fp8Accuracy,
    ::testing::Combine(::testing::Values(Precision::kFp8, Precision::kMxfp8),
                       ::testing::Values(AccuracyCase{"uniform", "uniform", false, 0.0},
                                         AccuracyCase{"skewed_signed_unused", "skewed:1.5", true,
                                                      0.2})),
    [](const auto& info) {
      return std::string(precision_name(std::get<0>(info.param))) + "_" +
             std::get<1>(info.param).name;
    });

// ---- blockwise against per-row scaling
// ---------------------------------------------------------------

// Scales x and dy by 2^-16 in every other 128-block of H, and the weights that multiply those
// blocks by 2^16 (exact in bf16), so that every block matters as much as before: the outliers of
// real activations, which one scale per row must cover with one exponent range (the small blocks
// fall into E4M3's subnormals or to zero) while one scale per block adapts.
void vary_block_magnitudes(Problem& problem) {
  const int64_t hidden = problem.shape.hidden, inter = problem.shape.intermediate;
  const auto scale = [](std::vector<bf16>& tensor, auto&& factor_of) {
    for (size_t index = 0; index < tensor.size(); ++index) {
      tensor[index] = bf16(tensor[index].to_float() * factor_of(static_cast<int64_t>(index)));
    }
  };
  const auto odd_block = [](int64_t k) { return (k / 128) % 2 == 1; };
  const auto small = [&](int64_t index) { return odd_block(index % hidden) ? 0x1p-16f : 1.0f; };
  const auto large = [&](int64_t index) { return odd_block(index % hidden) ? 0x1p16f : 1.0f; };
  scale(problem.x, small);
  scale(problem.dy, small);
  scale(problem.gate, large);  // (E, I, H): K = H
  scale(problem.up, large);
  scale(problem.shared_gate, large);
  scale(problem.shared_up, large);
  // (E, H, I) and (H, I_s): the row index n is the one dy's blocks scale.
  scale(problem.down,
        [&](int64_t index) { return odd_block((index / inter) % hidden) ? 0x1p16f : 1.0f; });
  const int64_t shared_inter = problem.shape.shared_intermediate;
  scale(problem.shared_down,
        [&](int64_t index) { return odd_block((index / shared_inter) % hidden) ? 0x1p16f : 1.0f; });
}

TEST(Fp8Rowwise, BlockwiseIsNoWorseThanPerRowScaling) {
  for (bool varied : {false, true}) {
    SCOPED_TRACE(varied ? "magnitudes varying by block" : "unit-normal data");
    Problem problem = Problem::generate({fp8_shape(), 128, Routing::parse("skewed:1"), 23});
    if (varied) vary_block_magnitudes(problem);
    const reference::OracleResult exact =
        reference::oracle(problem.shape, problem.all_rank_inputs(1), true)[0];
    const OutputErrors blockwise =
        OutputErrors::of(run_recipe(problem, QuantRecipe::of(Precision::kFp8)), exact);
    const OutputErrors rowwise =
        OutputErrors::of(run_recipe(problem, QuantRecipe::rowwise_fp8()), exact);
    for (size_t index = 0; index < blockwise.entries.size(); ++index) {
      const auto& [name, stats] = blockwise.entries[index];
      const double rowwise_error = rowwise.entries[index].second.relative_l2;
      std::cout << "  " << (varied ? "varied " : "normal ") << name << ": blockwise "
                << stats.relative_l2 << ", rowwise " << rowwise_error << "\n";
      // Without block structure the two recipes round alike (E4M3 is a float format: the
      // scale's exponent hardly matters), equal up to the noise of which values round which
      // way; with it, the per-row scale flushes the small blocks.
      EXPECT_LE(stats.relative_l2, (varied ? 0.5 : 1.05) * rowwise_error) << name;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Modes, Fp8Reference, ::testing::Values(Precision::kFp8, Precision::kMxfp8),
                         [](const auto& info) { return std::string(precision_name(info.param)); });

}  // namespace
}  // namespace mok
