// The fused forward (one persistent kernel for dispatch, the shared and routed expert GEMMs and
// the combine push) against the unfused composition bitwise, and through it against the CPU
// reference; EP=1 equals EP=2; repeats, graph replays and every setting of communication CTAs,
// minibatch and compute CTAs give the same bits. Routings: uniform, skewed, all tokens to one
// expert, empty experts, -1 slots; token counts that are not multiples of 128.
#include <gtest/gtest.h>

#include <vector>

#include "layer_test_support.cuh"

namespace mok::comm_test {
namespace {

GpuRun fused_run(int comm_ctas = 0, int minibatch_rows = 0, int compute_sms = 0) {
  GpuRun run;
  run.layer.fused.enabled = true;
  run.layer.fused.comm_ctas = comm_ctas;
  run.layer.fused.minibatch_rows = minibatch_rows;
  run.layer.gemm.num_sms = compute_sms;
  return run;
}

TEST(FusedForwardEp1, EqualsUnfusedBitwiseAndRepeats) {
  MOK_REQUIRE_HOPPER_GPUS(1);
  for (bool wider : {false, true}) {
    SCOPED_TRACE(wider ? "H 512, I 192, top-6" : "H 256, I 128, top-4");
    const Problem problem = layer_problem({"uniform", 0.1, true, true}, 300, 11, wider);
    GpuRun fused = fused_run();
    fused.repeats = 3;
    fused.trace = wider;  // the timeline must not change a bit
    const std::vector<bf16> y = run_gpu_layer(problem, 1, fused);
    expect_matches_reference(problem, 1, y);
    EXPECT_EQ(first_difference(run_gpu_layer(problem, 1, GpuRun{}), y), -1)
        << "fused differs from unfused";
  }
}

class FusedForwardEp2 : public ::testing::TestWithParam<Case> {};

TEST_P(FusedForwardEp2, EqualsUnfusedAndEp1Bitwise) {
  MOK_REQUIRE_HOPPER_GPUS(2);
  const Problem problem = layer_problem(GetParam(), 2 * 173, 5, true);  // 173 tokens per rank
  GpuRun fused = fused_run(3, 256);
  fused.repeats = 2;
  fused.extra_capacity = 3;
  const std::vector<bf16> ep2 = run_gpu_layer(problem, 2, fused);
  expect_matches_reference(problem, 2, ep2);
  EXPECT_EQ(first_difference(run_gpu_layer(problem, 2, GpuRun{}), ep2), -1)
      << "fused differs from unfused";
  EXPECT_EQ(first_difference(run_gpu_layer(problem, 1, fused), ep2), -1)
      << "EP=1 differs from EP=2";
}

INSTANTIATE_TEST_SUITE_P(
    Routings, FusedForwardEp2,
    ::testing::Values(Case{"uniform", 0.0, false, true}, Case{"skewed:1.5", 0.0, true, true},
                      Case{"skewed:4", 0.0, false, true},  // most experts empty
                      Case{"single-expert", 0.0, false, false},
                      Case{"uniform", 0.35, true, false}),
    [](const auto& info) { return case_name(info.param); });

TEST(FusedForwardEp2Settings, CommCtasMinibatchAndComputeCtasDoNotChangeABit) {
  MOK_REQUIRE_HOPPER_GPUS(2);
  const Problem problem = layer_problem({"skewed:1.2", 0.1, true, true}, 2 * 300, 21, true);
  const std::vector<bf16> expected = run_gpu_layer(problem, 2, GpuRun{});  // unfused
  expect_matches_reference(problem, 2, expected);
  struct Setting {
    int comm_ctas, minibatch_rows, compute_sms;
  };
  // One row block per minibatch with a single communication CTA and 2 compute CTAs: the longest
  // task list and the most waiting; then wider settings up to the defaults.
  for (const Setting setting : {Setting{1, 128, 2}, Setting{5, 384, 37}, Setting{20, 4096, 0},
                                Setting{64, 100000, 0}, Setting{0, 0, 0}}) {
    const GpuRun run = fused_run(setting.comm_ctas, setting.minibatch_rows, setting.compute_sms);
    EXPECT_EQ(first_difference(run_gpu_layer(problem, 2, run), expected), -1)
        << "comm CTAs " << setting.comm_ctas << ", minibatch rows " << setting.minibatch_rows
        << ", compute SMs " << setting.compute_sms << " differs from the unfused forward";
  }
  GpuRun separate_schedule = fused_run(3, 256);
  separate_schedule.layer.fused.schedule_in_kernel = false;  // the schedule's own kernels first
  EXPECT_EQ(first_difference(run_gpu_layer(problem, 2, separate_schedule), expected), -1)
      << "the fused kernel after the schedule kernels differs from the unfused forward";
  EXPECT_EQ(first_difference(run_gpu_layer(problem, 1, fused_run(2, 128, 5)), expected), -1)
      << "EP=1 differs from EP=2";
}

TEST(FusedForwardEp2Graph, GraphReplayEqualsEagerAndUnfused) {
  MOK_REQUIRE_HOPPER_GPUS(2);
  const Problem problem = layer_problem({"uniform", 0.2, true, true}, 2 * 250, 31, true);
  GpuRun run = fused_run(4, 512);
  run.use_graph = true;  // run_gpu_layer throws if a replay differs from the eager run
  run.callers_weights = true;
  EXPECT_EQ(first_difference(run_gpu_layer(problem, 2, run), run_gpu_layer(problem, 2, GpuRun{})),
            -1)
      << "fused differs from unfused";
}

}  // namespace
}  // namespace mok::comm_test
