// The chunked GPU backward (LayerBackwardOptions::chunk_rows): the routed experts a chunk of whole
// experts at a time splits no sum, so every output must have the bits of the backward that holds
// every routed row at once — in recompute and save mode, at the smallest chunk (T_max rows, about
// one expert a chunk), the low-memory one (1.5 T_max) and one that holds every row, accumulating
// into main_grad, in a replayed graph; routings with empty experts, all tokens on one expert,
// unused slots, T = 1 and odd T, top-1 and top-8, many experts. Outputs are NaN-poisoned before
// each run (backward_test_support.cuh), so a row a chunk missed shows as a difference. And, host
// only, the buffers it saves and the arguments it refuses.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "backward_test_support.cuh"

namespace mok::comm_test {
namespace {

bool same_shared_bits(const BackwardOutputs& a, const BackwardOutputs& b) {
  return same_bits(a.grad_shared_gate, b.grad_shared_gate) &&
         same_bits(a.grad_shared_up, b.grad_shared_up) &&
         same_bits(a.grad_shared_down, b.grad_shared_down);
}

// The chunked backward of `run`'s mode at each chunk size against the unchunked one.
void expect_chunks_equal_whole(const Problem& problem, BackwardRun run) {
  const int64_t tokens = problem.num_tokens;
  const BackwardOutputs whole = run_gpu_backward(problem, 1, run);
  for (int64_t chunk_rows : {std::max<int64_t>(tokens, 1), low_memory_chunk_rows(tokens),
                             std::max<int64_t>(tokens, 1) * problem.shape.top_k}) {
    SCOPED_TRACE("chunk_rows " + std::to_string(chunk_rows));
    run.layer.chunk_rows = chunk_rows;
    const BackwardOutputs chunked = run_gpu_backward(problem, 1, run);
    EXPECT_EQ(first_different_tensor(chunked, whole), "");
    EXPECT_TRUE(same_shared_bits(chunked, whole)) << "shared expert gradients differ";
  }
}

class LayerBackwardChunks : public ::testing::TestWithParam<Case> {};

TEST_P(LayerBackwardChunks, EqualEveryExpertAtOnceBitwise) {
  MOK_REQUIRE_HOPPER_GPUS(1);
  for (bool wider : {false, true}) {
    SCOPED_TRACE(wider ? "H 512, I 192, I_s 64, E 16, top-6" : "tiny preset");
    const Problem problem = layer_problem(GetParam(), 301, 53, wider);
    for (bool save : {false, true}) {
      SCOPED_TRACE(save ? "save mode" : "recompute mode");
      BackwardRun run;
      run.save = save;
      run.repeats = save ? 0 : 1;
      expect_chunks_equal_whole(problem, run);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Routings, LayerBackwardChunks, ::testing::ValuesIn(kBackwardRoutings),
                         [](const auto& info) { return case_name(info.param); });

TEST(LayerBackwardChunksShapes, OddShapesEqualEveryExpertAtOnce) {
  MOK_REQUIRE_HOPPER_GPUS(1);
  // (H, I, I_s, E, k): top-1 without a shared expert; many experts with a few rows each, top-8.
  const std::vector<LayerShape> shapes = {{256, 136, 0, 8, 1}, {384, 72, 200, 64, 8}};
  for (const LayerShape& shape : shapes) {
    for (int64_t tokens : {int64_t{1}, int64_t{77}}) {
      SCOPED_TRACE("I " + std::to_string(shape.intermediate) + " E " +
                   std::to_string(shape.num_experts) + ", " + std::to_string(tokens) + " tokens");
      const Problem problem =
          testing::make_problem({"uniform", 0.1, true, true}, tokens, 11, shape);
      BackwardRun run;
      run.save = true;
      run.repeats = 0;
      expect_chunks_equal_whole(problem, run);
    }
  }
}

TEST(LayerBackwardChunks, AccumulatesAndReplaysInAGraph) {
  MOK_REQUIRE_HOPPER_GPUS(1);
  const Problem problem = layer_problem({"skewed:1.2", 0.1, true, true}, 200, 29, true);
  BackwardRun accumulate;
  accumulate.mode = GradMode::kAccumulate;
  accumulate.main_grad_start = 0.25f;
  accumulate.repeats = 0;
  expect_chunks_equal_whole(problem, accumulate);
  BackwardRun graph;
  graph.save = true;
  graph.use_graph = true;  // run_gpu_backward throws if a replay differs from the eager run
  graph.repeats = 0;
  expect_chunks_equal_whole(problem, graph);
}

// The buffers of the low-memory chunk at the issue's shapes, one rank: the routed intermediates
// of one chunk (1.5 T rows) instead of T k rows'. Host only.
TEST(LayerBackwardChunks, LowMemoryChunkHoldsLessThanEveryRow) {
  for (const char* preset : {"qwen3-30b-a3b", "deepseek-v3", "qwen3-235b-a22b"}) {
    SCOPED_TRACE(preset);
    const LayerShape shape = find_preset(preset).shape;
    const int64_t tokens = 8192;
    LayerBackwardOptions chunked;
    chunked.chunk_rows = low_memory_chunk_rows(tokens);
    for (bool recompute : {false, true}) {
      const int64_t whole = LayerBackward::buffer_bytes(shape, 1, tokens, {}, recompute);
      const int64_t less = LayerBackward::buffer_bytes(shape, 1, tokens, chunked, recompute);
      // At least the intermediates (g, w·h; recompute: gate/up) of T k - 1.5 T rows, less a chunk
      // of x's or dy's rows and the shared dx where the chunk's bytes cannot hold it.
      const int64_t rows_saved = tokens * shape.top_k - chunked.chunk_rows;
      const int64_t per_row = shape.intermediate * (recompute ? 10 : 6);
      const int64_t shared_dx =
          shared_dx_in_chunk(shape, tokens, chunked.chunk_rows) ? 0 : tokens * shape.hidden * 4;
      EXPECT_LE(less, whole - rows_saved * per_row + chunked.chunk_rows * shape.hidden * 2 +
                          shared_dx + (int64_t{1} << 20))
          << "whole " << whole << " B, chunked " << less << " B";
      EXPECT_LT(less, whole);
    }
  }
}

TEST(LayerBackwardChunks, RefusesChunksSmallerThanTokensMax) {
  MOK_REQUIRE_HOPPER_GPUS(1);
  const std::vector<Communicator>& comms = test_communicators(1);
  LayerBackwardOptions options;
  options.chunk_rows = 63;
  try {
    LayerBackward layer(comms[0], find_preset("tiny").shape, 64, options);
    FAIL() << "63-row chunks for 64 tokens were accepted";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("chunk_rows"), std::string::npos) << error.what();
  }
}

}  // namespace
}  // namespace mok::comm_test
