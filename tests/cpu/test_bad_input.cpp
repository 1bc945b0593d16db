// Every bad input gives a mok::Error that names the argument and the offending value, before any
// output is touched: each test ends with expect_untouched, which checks every output.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>

#include "helpers.hpp"

namespace mok {
namespace {

// Runs `call` and checks it throws mok::Error for `argument` with `fragment` in the message.
void expect_error(const std::function<void()>& call, const std::string& argument,
                  const std::string& fragment) {
  try {
    call();
    ADD_FAILURE() << "no error; expected one about " << argument;
  } catch (const Error& error) {
    EXPECT_EQ(error.argument(), argument) << error.what();
    EXPECT_NE(std::string(error.what()).find(fragment), std::string::npos)
        << "message '" << error.what() << "' lacks '" << fragment << "'";
  }
}

class BadInput : public ::testing::Test {
 protected:
  BadInput()
      : problem_(Problem::generate({testing::tiny_shape(), 32, Routing::parse("uniform"), 1})),
        outputs_(ProblemOutputs::poisoned(problem_, 2)) {}

  // Forward and backward over two ranks with the (possibly broken) inputs.
  void run(const std::vector<reference::RankInputs>& ranks, const LayerShape& shape) {
    const std::vector<reference::RankOutputs> views = outputs_.rank_outputs(problem_);
    reference::forward(shape, ranks, views);
    reference::backward(shape, ranks, views, GradMode::kOverwrite);
  }
  void run(const std::vector<reference::RankInputs>& ranks) { run(ranks, problem_.shape); }
  // Backward alone: what forward does not read (dy) must be refused before any gradient is written.
  void run_backward(const std::vector<reference::RankInputs>& ranks) {
    const std::vector<reference::RankOutputs> views = outputs_.rank_outputs(problem_);
    reference::backward(problem_.shape, ranks, views, GradMode::kOverwrite);
  }
  // Every output (y, dx, d_topk_w, every weight gradient) still holds its poison.
  void expect_untouched() { testing::expect_untouched(problem_, outputs_); }

  Problem problem_;
  ProblemOutputs outputs_;
};

TEST_F(BadInput, ExpertIdOutOfRange) {
  problem_.topk_idx[9] = 16;
  expect_error([&] { run(problem_.all_rank_inputs(2)); }, "topk_idx",
               "expert id 16 out of range [0, 16) at token 2, slot 1");
  problem_.topk_idx[9] = -2;
  expect_error([&] { run(problem_.all_rank_inputs(2)); }, "topk_idx", "expert id -2");
  expect_untouched();
}

TEST_F(BadInput, RepeatedExpertInARow) {
  problem_.topk_idx[5] = problem_.topk_idx[4];
  expect_error([&] { run(problem_.all_rank_inputs(2)); }, "topk_idx",
               detail::concat("expert id ", problem_.topk_idx[4],
                              " repeated at token 1, slot 1 (also at slot 0; "
                              "the ids of a row must be distinct, only -1 may repeat)"));
  expect_untouched();
}

// A repeat is found anywhere in a row and on any rank, named by its later slot (the token index is
// the rank's own, as for an id out of range); unused slots (-1) may repeat.
TEST_F(BadInput, RepeatedExpertAnywhereInARowButUnusedSlotsMayRepeat) {
  const int64_t top_k = problem_.shape.top_k;
  int32_t* row = problem_.topk_idx.data() + (16 + 3) * top_k;  // rank 1's token 3 of 16
  const int32_t first = row[0], last = row[3];
  row[3] = first;
  expect_error(
      [&] { run(problem_.all_rank_inputs(2)); }, "topk_idx",
      detail::concat("expert id ", first, " repeated at token 3, slot 3 (also at slot 0;"));
  row[3] = last;
  row[1] = row[2] = -1;
  row[2] = first;  // [e, -1, e, e']: the repeat skips the -1 between
  expect_error(
      [&] { run(problem_.all_rank_inputs(2)); }, "topk_idx",
      detail::concat("expert id ", first, " repeated at token 3, slot 2 (also at slot 0;"));
  expect_untouched();

  row[2] = -1;  // [e, -1, -1, e']: accepted, and the token's y is written
  ProblemOutputs outputs;
  ASSERT_NO_THROW(outputs = testing::run_layer(problem_, 2));
  for (int64_t n = 0; n < problem_.shape.hidden; ++n) {
    ASSERT_TRUE(std::isfinite(outputs.y[(16 + 3) * problem_.shape.hidden + n].to_float())) << n;
  }
}

TEST_F(BadInput, NonFiniteRouterWeights) {
  problem_.topk_w[6] = std::nanf("");
  expect_error([&] { run(problem_.all_rank_inputs(2)); }, "topk_w",
               "non-finite router weight nan at token 1, slot 2");
  problem_.topk_w[6] = INFINITY;
  expect_error([&] { run(problem_.all_rank_inputs(2)); }, "topk_w", "non-finite router weight inf");
  expect_untouched();
}

TEST_F(BadInput, ZeroTokens) {
  std::vector<reference::RankInputs> ranks = problem_.all_rank_inputs(2);
  ranks[1].tokens.x.shape[0] = 0;
  expect_error([&] { run(ranks); }, "x", "T = 0 tokens");
  expect_untouched();
}

TEST_F(BadInput, ShapeMismatches) {
  std::vector<reference::RankInputs> ranks = problem_.all_rank_inputs(2);
  ranks[0].tokens.x.shape[1] = 65;
  expect_error([&] { run(ranks); }, "x", "shape [16, 65], expected [16, 64]");
  ranks = problem_.all_rank_inputs(2);
  ranks[0].tokens.topk_w.shape[1] = 3;
  expect_error([&] { run(ranks); }, "topk_w", "shape [16, 3], expected [16, 4]");
  ranks = problem_.all_rank_inputs(2);
  ranks[1].weights.down.shape = {8, 32, 64};
  expect_error([&] { run(ranks); }, "w_down", "shape [8, 32, 64], expected [8, 64, 32]");
  ranks = problem_.all_rank_inputs(2);
  ranks[0].weights.shared_gate = {};
  expect_error([&] { run(ranks); }, "w_shared_gate", "expected [48, 64]");
  ranks = problem_.all_rank_inputs(2);
  ranks[0].dy.shape = {15, 64};  // forward does not read dy: backward reports it
  expect_error([&] { run_backward(ranks); }, "dy", "shape [15, 64], expected [16, 64]");
  expect_untouched();
}

TEST_F(BadInput, OutputShapeMismatch) {
  std::vector<reference::RankOutputs> views = outputs_.rank_outputs(problem_);
  views[1].grads.up.shape = {8, 32, 63};
  const std::vector<reference::RankInputs> ranks = problem_.all_rank_inputs(2);
  expect_error([&] { reference::backward(problem_.shape, ranks, views, GradMode::kOverwrite); },
               "grad_up", "shape [8, 32, 63], expected [8, 32, 64]");
  views.pop_back();
  expect_error([&] { reference::forward(problem_.shape, ranks, views); }, "outputs",
               "1 output sets for 2 ranks");
  expect_untouched();
}

TEST_F(BadInput, TopKAboveExpertCount) {
  LayerShape shape = problem_.shape;
  shape.top_k = 17;
  expect_error([&] { shape.validate(); }, "top_k", "k = 17 exceeds the number of experts E = 16");
  expect_error([&] { run(problem_.all_rank_inputs(2), shape); }, "top_k", "k = 17 exceeds");
  expect_untouched();
}

TEST_F(BadInput, ExpertsNotDivisibleByRanks) {
  expect_error([&] { problem_.shape.validate(3); }, "ep",
               "E = 16 experts do not divide over 3 ranks");
  std::vector<reference::RankInputs> three = {
      problem_.rank_inputs(0, 2), problem_.rank_inputs(1, 2), problem_.rank_inputs(1, 2)};
  expect_error([&] { run(three); }, "ep", "do not divide over 3 ranks");
  expect_untouched();
}

TEST_F(BadInput, BadShapeFields) {
  expect_error([] { LayerShape{0, 32, 0, 16, 4}.validate(); }, "hidden", "must be positive, got 0");
  expect_error(
      [] {
        LayerShape{60, 32, 0, 16, 4}.validate();
      },
      "hidden", "multiple of 8 (16-byte rows), got 60");
  expect_error(
      [] {
        LayerShape{64, 32, -8, 16, 4}.validate();
      },
      "shared_intermediate", ">= 0, got -8");
  expect_error([] { LayerShape{64, 32, 0, 16, 0}.validate(); }, "top_k", "must be positive, got 0");
  expect_error(
      [&] {
        run(problem_.all_rank_inputs(2), LayerShape{60, 32, 48, 16, 4});
      },
      "hidden", "multiple of 8 (16-byte rows), got 60");
  expect_untouched();
}

TEST_F(BadInput, UnknownPresetAndRouting) {
  expect_error([] { find_preset("gpt-5"); }, "preset", "unknown preset 'gpt-5' (known: tiny,");
  expect_error([] { Routing::parse("zipf"); }, "routing", "unknown routing 'zipf'");
  expect_error([] { Routing::parse("skewed:abc"); }, "routing", "skewed:ALPHA needs ALPHA");
  expect_untouched();  // nothing ran; kept so that every bad-input test ends with the check
}

}  // namespace
}  // namespace mok
