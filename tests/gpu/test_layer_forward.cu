// The unfused GPU layer forward (LayerForward: schedule, dispatch, grouped SwiGLU and down GEMMs,
// shared expert, combine) against the CPU reference within bf16 tolerance, and its determinism
// contracts bitwise: EP=1 equals EP=2, repeats are equal, GEMM and copy SM counts do not change a
// bit, a replayed CUDA graph equals the eager run. Routings: uniform, skewed, all tokens to one
// expert, empty experts, -1 slots; token counts that are not multiples of 128.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "layer_test_support.cuh"

namespace mok::comm_test {
namespace {

// ---- EP = 1 on one GPU ------------------------------------------------------------------------

TEST(LayerForwardEp1, MatchesReferenceAndRepeatsBitwise) {
  MOK_REQUIRE_HOPPER_GPUS(1);
  for (bool wider : {false, true}) {
    SCOPED_TRACE(wider ? "H 512, I 192, top-6" : "H 256, I 128, top-4");
    const Problem problem =
        layer_problem({"uniform", 0.1, true, true}, 300, 11, wider);  // 300 % 128 != 0
    GpuRun run;
    run.repeats = 3;
    expect_matches_reference(problem, 1, run_gpu_layer(problem, 1, run));
  }
}

TEST(LayerForwardEp1, GraphReplayEqualsEager) {
  MOK_REQUIRE_HOPPER_GPUS(1);
  const Problem problem = layer_problem({"skewed:1.2", 0.1, true, true}, 200, 12);
  GpuRun run;
  run.use_graph = true;  // run_gpu_layer throws if a replay differs from the eager run
  expect_matches_reference(problem, 1, run_gpu_layer(problem, 1, run));
}

TEST(LayerForwardEp1, RejectsTooManyTokensNamingTheArgument) {
  MOK_REQUIRE_HOPPER_GPUS(1);
  const LayerShape shape = find_preset("tiny").shape;
  LayerForward layer(local_communicators(1)[0], shape, 64);
  try {
    layer.forward(nullptr, nullptr, nullptr, nullptr, 65, nullptr);
    FAIL() << "65 tokens accepted with tokens_max 64";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("num_tokens"), std::string::npos) << error.what();
  }
}

// ---- EP = 2 -------------------------------------------------------------------------------------

class LayerForwardEp2 : public ::testing::TestWithParam<Case> {};

TEST_P(LayerForwardEp2, MatchesReferenceAndEp1Bitwise) {
  MOK_REQUIRE_HOPPER_GPUS(1);  // (EP 2 emulated on one GPU where there is one)
  const Problem problem = layer_problem(GetParam(), 2 * 173, 5);  // 173 tokens per rank
  GpuRun run;
  run.repeats = 2;
  run.extra_capacity = 3;
  const std::vector<bf16> ep2 = run_gpu_layer(problem, 2, run);
  expect_matches_reference(problem, 2, ep2);
  const std::vector<bf16> ep1 = run_gpu_layer(problem, 1, run);
  EXPECT_EQ(first_difference(ep1, ep2), -1) << "EP=1 differs from EP=2";
}

INSTANTIATE_TEST_SUITE_P(
    Routings, LayerForwardEp2,
    ::testing::Values(Case{"uniform", 0.0, false, true}, Case{"skewed:1.5", 0.0, true, true},
                      Case{"skewed:4", 0.0, false, true},  // most experts empty
                      Case{"single-expert", 0.0, false, false}, Case{"uniform", 0.35, true, false}),
    [](const auto& info) { return case_name(info.param); });

TEST(LayerForwardEp2Settings, GemmAndCopySmCountsDoNotChangeABit) {
  MOK_REQUIRE_HOPPER_GPUS(1);  // (EP 2 emulated on one GPU where there is one)
  const Problem problem = layer_problem({"skewed:1.2", 0.1, true, true}, 2 * 300, 21, true);
  std::vector<GpuRun> settings(4);
  settings[1].layer.gemm.num_sms = 37;
  settings[1].layer.copy = {5, 256};
  settings[2].layer.gemm.num_sms = 8;
  settings[2].layer.copy = {64, 512};
  settings[3].layer.overlap_shared_with_dispatch = false;  // shared expert, then dispatch
  settings.emplace_back().callers_weights = true;          // weights passed per call
  const std::vector<bf16> expected = run_gpu_layer(problem, 2, settings[0]);
  expect_matches_reference(problem, 2, expected);
  for (size_t index = 1; index < settings.size(); ++index) {
    EXPECT_EQ(first_difference(run_gpu_layer(problem, 2, settings[index]), expected), -1)
        << "setting " << index << " (GEMM SMs " << settings[index].layer.gemm.num_sms
        << ", copy CTAs " << settings[index].layer.copy.num_ctas << ", overlap "
        << settings[index].layer.overlap_shared_with_dispatch << ", caller's weights "
        << settings[index].callers_weights << ") differs";
  }
  GpuRun one_rank = settings[1];
  EXPECT_EQ(first_difference(run_gpu_layer(problem, 1, one_rank), expected), -1)
      << "EP=1 differs from EP=2";
}

TEST(LayerForwardEp2Graph, GraphReplayEqualsEagerAndReference) {
  MOK_REQUIRE_HOPPER_GPUS(1);  // (EP 2 emulated on one GPU where there is one)
  const Problem problem = layer_problem({"uniform", 0.2, true, true}, 2 * 250, 31, true);
  GpuRun run;
  run.use_graph = true;
  run.layer.copy = {8};
  expect_matches_reference(problem, 2, run_gpu_layer(problem, 2, run));
}

}  // namespace
}  // namespace mok::comm_test
