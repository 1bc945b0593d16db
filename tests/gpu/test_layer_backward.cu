// The GPU layer backward (LayerBackward) against the CPU reference and the fp64 oracle, and its
// determinism contracts bitwise: repeats, GEMM and copy SM counts, the dispatch beside the shared
// expert or after it, a replayed CUDA graph, save mode (the fused forward's saved context, with
// and without ring rounds) against recompute mode, and EP = 1 against EP = 2 (where two GPUs are
// present). Every output, and a saved context, is NaN-poisoned before each run.
// Routings: uniform with unused slots and signed weights, skewed (most experts empty), all tokens
// to one expert; token counts 1, odd, and not multiples of 128; top-k 1 to 6.
#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "backward_test_support.cuh"

namespace mok::comm_test {
namespace {

// Each output's error against the fp64 oracle: finite everywhere, within bf16 tolerance, and no
// more than twice the CPU reference's (same rounding points, fp32 sums in another order).
void expect_matches_reference(const Problem& problem, int ep, const BackwardOutputs& gpu,
                              const BackwardRun& run) {
  ProblemOutputs cpu = ProblemOutputs::poisoned(problem, ep);
  const std::vector<reference::RankInputs> ranks = problem.all_rank_inputs(ep);
  auto start = [&](std::vector<float>& grad) {
    if (run.mode == GradMode::kAccumulate) grad.assign(grad.size(), run.main_grad_start);
  };
  for (auto* grad : {&cpu.grad_gate, &cpu.grad_up, &cpu.grad_down, &cpu.grad_shared_gate,
                     &cpu.grad_shared_up, &cpu.grad_shared_down}) {
    start(*grad);
  }
  reference::backward(problem.shape, ranks, cpu.rank_outputs(problem), run.mode);
  std::vector<reference::OracleResult> oracle = reference::oracle(problem.shape, ranks, true);
  auto joined = [&](auto member, double offset) {
    std::vector<double> values;
    for (const reference::OracleResult& rank : oracle) {
      for (double value : rank.*member) values.push_back(value + offset);
    }
    return values;
  };
  const double offset = run.mode == GradMode::kAccumulate ? run.main_grad_start : 0.0;
  auto check = [&](const char* name, const auto& gpu_values, const auto& cpu_values,
                   const std::vector<double>& oracle_values) {
    SCOPED_TRACE(name);
    ASSERT_EQ(gpu_values.size(), oracle_values.size());
    const ErrorStats gpu_error = compare(gpu_values, oracle_values);
    const ErrorStats cpu_error = compare(cpu_values, oracle_values);
    EXPECT_EQ(gpu_error.non_finite, 0) << "unwritten (NaN) elements";
    EXPECT_TRUE(gpu_error.within(kBf16Tolerance)) << "GPU vs oracle: " << gpu_error.describe();
    EXPECT_LE(gpu_error.relative_l2, 2.0 * cpu_error.relative_l2 + 1e-4)
        << "GPU vs oracle: " << gpu_error.describe()
        << "; CPU reference vs oracle: " << cpu_error.describe();
  };
  check("dx", gpu.dx, cpu.dx, joined(&reference::OracleResult::dx, 0.0));
  check("d_topk_w", gpu.d_topk_w, cpu.d_topk_w, joined(&reference::OracleResult::d_topk_w, 0.0));
  check("grad_gate", gpu.grad_gate, cpu.grad_gate,
        joined(&reference::OracleResult::grad_gate, offset));
  check("grad_up", gpu.grad_up, cpu.grad_up, joined(&reference::OracleResult::grad_up, offset));
  check("grad_down", gpu.grad_down, cpu.grad_down,
        joined(&reference::OracleResult::grad_down, offset));
  if (problem.shape.has_shared()) {
    check("grad_shared_gate", gpu.grad_shared_gate, cpu.grad_shared_gate,
          joined(&reference::OracleResult::grad_shared_gate, offset));
    check("grad_shared_up", gpu.grad_shared_up, cpu.grad_shared_up,
          joined(&reference::OracleResult::grad_shared_up, offset));
    check("grad_shared_down", gpu.grad_shared_down, cpu.grad_shared_down,
          joined(&reference::OracleResult::grad_shared_down, offset));
  }
  // Unused slots get exactly 0.
  for (size_t slot = 0; slot < gpu.d_topk_w.size(); ++slot) {
    if (problem.topk_idx[slot] < 0) {
      ASSERT_EQ(gpu.d_topk_w[slot], 0.0f) << "unused slot " << slot;
    }
  }
}

// ---- EP = 1 on one GPU ------------------------------------------------------------------------

class LayerBackwardEp1 : public ::testing::TestWithParam<Case> {};

// Each backward's phase order (its phase marks follow it) names every phase once; one rank's
// keeps the order its shared rows need (expert_dy holds x's, dy's, the dx and x's rows in turn):
// the gate/up recompute before dy's rows, the down wgrad before the dx rows, the reduce before x's
// rows come back, the gate/up wgrad after them. Host only.
TEST(BackwardPhases, EachOrderNamesEveryPhaseOnce) {
  for (const BackwardPhaseOrder& order : {kBackwardPhaseOrder, kOneRankBackwardPhaseOrder}) {
    std::vector<int> seen(kNumBackwardPhases, 0);
    for (BackwardPhase phase : order) ++seen[static_cast<int>(phase)];
    for (int phase = 0; phase < kNumBackwardPhases; ++phase) {
      EXPECT_EQ(seen[phase], 1) << phase_name(static_cast<BackwardPhase>(phase));
    }
  }
  const auto place = [](BackwardPhase phase) {
    int index = 0;
    while (kOneRankBackwardPhaseOrder[index] != phase) ++index;
    return index;
  };
  EXPECT_LT(place(BackwardPhase::kGateUp), place(BackwardPhase::kDispatch));
  EXPECT_LT(place(BackwardPhase::kDispatch), place(BackwardPhase::kDownDgrad));
  EXPECT_LT(place(BackwardPhase::kWgradDown), place(BackwardPhase::kGateUpDgrad));
  EXPECT_LT(place(BackwardPhase::kGateUpDgrad), place(BackwardPhase::kCombineReduce));
  EXPECT_LT(place(BackwardPhase::kCombineReduce), place(BackwardPhase::kDispatchX));
  EXPECT_LT(place(BackwardPhase::kDispatchX), place(BackwardPhase::kWgradGateUp));
}

// One rank's shared expert keeps its fp32 dx in w·h's bytes where they hold it (k·I >= 2H, as
// deepseek-v3's 8 × 2048 against 2 × 7168): the buffers grow by the shared expert's g and h alone.
// Elsewhere (or at EP 2) the dx has its own T_max·H·4 bytes. Host only.
TEST(LayerBackwardBuffers, OneRanksSharedDxTakesWeightedHiddensBytes) {
  const int64_t tokens = 8192;
  const LayerShape deepseek = find_preset("deepseek-v3").shape;
  ASSERT_TRUE(deepseek.has_shared());
  ASSERT_GE(deepseek.top_k * deepseek.intermediate, 2 * deepseek.hidden);
  const auto bytes = [&](const LayerShape& shape, int ranks) {
    return LayerBackward::buffer_bytes(shape, ranks, tokens, {}, /*recompute=*/false);
  };
  const auto extra = [&](LayerShape shape, int ranks) {
    const int64_t with = bytes(shape, ranks);
    shape.shared_intermediate = 0;
    return with - bytes(shape, ranks);
  };
  const int64_t g_and_h = tokens * deepseek.shared_intermediate * (4 + 2);
  const int64_t dx = tokens * deepseek.hidden * 4;
  EXPECT_EQ(extra(deepseek, 1), g_and_h);
  EXPECT_EQ(extra(deepseek, 2), g_and_h + dx);
  LayerShape narrow = deepseek;  // k·I < 2H: no room
  narrow.top_k = 2;
  EXPECT_EQ(extra(narrow, 1), g_and_h + dx);
}

TEST_P(LayerBackwardEp1, MatchesReferenceAndRepeatsBitwise) {
  MOK_REQUIRE_HOPPER_GPUS(1);
  for (bool wider : {false, true}) {
    SCOPED_TRACE(wider ? "H 512, I 192, I_s 64, top-6" : "H 256, I 128, top-4");
    const Problem problem = layer_problem(GetParam(), 301, 41, wider);  // 301: odd
    BackwardRun run;
    run.repeats = 2;
    expect_matches_reference(problem, 1, run_gpu_backward(problem, 1, run), run);
  }
}

INSTANTIATE_TEST_SUITE_P(Routings, LayerBackwardEp1,
                         ::testing::Values(Case{"uniform", 0.2, true, true},
                                           Case{"skewed:4", 0.0, false, true},
                                           Case{"single-expert", 0.0, true, false},
                                           Case{"uniform", 0.0, false, false}),
                         [](const auto& info) { return case_name(info.param); });

TEST(LayerBackwardEp1Shapes, OddShapesMatchReference) {
  MOK_REQUIRE_HOPPER_GPUS(1);
  // (H, I, I_s, E, k): top-1, many experts with few rows, I and I_s not multiples of 128.
  const std::vector<LayerShape> shapes = {
      {256, 136, 0, 8, 1}, {384, 72, 200, 64, 8}, {128, 256, 64, 4, 2}};
  for (const LayerShape& shape : shapes) {
    for (int64_t tokens : {int64_t{1}, int64_t{77}}) {
      SCOPED_TRACE("H " + std::to_string(shape.hidden) + " I " +
                   std::to_string(shape.intermediate) + " I_s " +
                   std::to_string(shape.shared_intermediate) + " E " +
                   std::to_string(shape.num_experts) + " k " + std::to_string(shape.top_k) + ", " +
                   std::to_string(tokens) + " tokens");
      const Problem problem = testing::make_problem({"uniform", 0.1, true, true}, tokens, 7, shape);
      BackwardRun run;
      expect_matches_reference(problem, 1, run_gpu_backward(problem, 1, run), run);
    }
  }
}

TEST(LayerBackwardEp1Settings, GemmAndCopySmCountsDoNotChangeABit) {
  MOK_REQUIRE_HOPPER_GPUS(1);
  const Problem problem = layer_problem({"skewed:1.2", 0.1, true, true}, 300, 21, true);
  std::vector<BackwardRun> settings(5);
  settings[1].layer.gemm.num_sms = 37;
  settings[1].layer.copy = {5, 256};
  settings[2].layer.gemm.num_sms = 8;
  settings[2].layer.copy = {64, 512};
  settings[3].layer.overlap_shared_with_dispatch = false;  // shared expert, then dispatch
  settings[3].layer.local_dispatch_on_every_sm = false;    // ... on copy.num_ctas CTAs
  settings[4].layer.overlap_shared_with_dispatch = false;  // ... on every SM
  const BackwardOutputs expected = run_gpu_backward(problem, 1, settings[0]);
  expect_matches_reference(problem, 1, expected, settings[0]);
  for (size_t index = 1; index < settings.size(); ++index) {
    const BackwardOutputs other = run_gpu_backward(problem, 1, settings[index]);
    EXPECT_EQ(first_different_tensor(other, expected), "") << "setting " << index;
    EXPECT_TRUE(same_bits(other.grad_shared_gate, expected.grad_shared_gate) &&
                same_bits(other.grad_shared_down, expected.grad_shared_down))
        << "setting " << index << ": shared expert gradients differ";
  }
}

TEST(LayerBackwardEp1, AccumulatesIntoMainGrad) {
  MOK_REQUIRE_HOPPER_GPUS(1);
  const Problem problem = layer_problem({"uniform", 0.1, true, true}, 200, 23);
  BackwardRun run;
  run.mode = GradMode::kAccumulate;
  run.main_grad_start = 0.25f;
  run.repeats = 1;
  expect_matches_reference(problem, 1, run_gpu_backward(problem, 1, run), run);
}

TEST(LayerBackwardEp1, GraphReplayEqualsEager) {
  MOK_REQUIRE_HOPPER_GPUS(1);
  const Problem problem = layer_problem({"skewed:1.2", 0.1, true, true}, 200, 12);
  BackwardRun run;
  run.use_graph = true;  // run_gpu_backward throws if a replay differs from the eager run
  expect_matches_reference(problem, 1, run_gpu_backward(problem, 1, run), run);
}

// Save mode reads what the fused forward kept instead of recomputing it: the same bits, whatever
// the forward's ring (one round, or rounds through the smallest ring with carried tails).
class LayerBackwardSaveMode : public ::testing::TestWithParam<Case> {};

bool same_shared_bits(const BackwardOutputs& a, const BackwardOutputs& b) {
  return same_bits(a.grad_shared_gate, b.grad_shared_gate) &&
         same_bits(a.grad_shared_up, b.grad_shared_up) &&
         same_bits(a.grad_shared_down, b.grad_shared_down);
}

TEST_P(LayerBackwardSaveMode, EqualsRecomputeBitwise) {
  MOK_REQUIRE_HOPPER_GPUS(1);
  for (bool wider : {false, true}) {
    SCOPED_TRACE(wider ? "H 512, I 192, I_s 64, top-6" : "H 256, I 128, top-4");
    const Problem problem = layer_problem(GetParam(), 301, 43, wider);
    const BackwardOutputs recompute = run_gpu_backward(problem, 1, BackwardRun{});
    std::vector<BackwardRun> saves(3);
    for (BackwardRun& save : saves) save.save = true;
    saves[0].repeats = 1;
    saves[1].forward.ring_rows = static_cast<int64_t>(kMinRingRows);  // rounds
    saves[1].forward.minibatch_rows = 128;
    saves[2].forward.comm_ctas = 4;
    saves[2].forward.schedule_in_kernel = false;
    for (size_t index = 0; index < saves.size(); ++index) {
      const BackwardOutputs save = run_gpu_backward(problem, 1, saves[index]);
      EXPECT_EQ(first_different_tensor(save, recompute), "") << "save setting " << index;
      EXPECT_TRUE(same_shared_bits(save, recompute))
          << "save setting " << index << ": shared expert gradients differ";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Routings, LayerBackwardSaveMode, ::testing::ValuesIn(kBackwardRoutings),
                         [](const auto& info) { return case_name(info.param); });

TEST(LayerBackwardSaveModeShapes, OddShapesEqualRecompute) {
  MOK_REQUIRE_HOPPER_GPUS(1);
  // top-1 with I not a multiple of 128 (a half column tile); many experts with a few rows each
  // (carried tails), I_s not a multiple of 128; T = 1.
  const std::vector<LayerShape> shapes = {{256, 136, 0, 8, 1}, {384, 72, 200, 64, 8}};
  for (const LayerShape& shape : shapes) {
    for (int64_t tokens : {int64_t{1}, int64_t{77}}) {
      SCOPED_TRACE("I " + std::to_string(shape.intermediate) + " E " +
                   std::to_string(shape.num_experts) + ", " + std::to_string(tokens) + " tokens");
      const Problem problem = testing::make_problem({"uniform", 0.1, true, true}, tokens, 9, shape);
      BackwardRun save;
      save.save = true;
      const BackwardOutputs saved = run_gpu_backward(problem, 1, save);
      expect_matches_reference(problem, 1, saved, save);
      const BackwardOutputs recompute = run_gpu_backward(problem, 1, BackwardRun{});
      EXPECT_EQ(first_different_tensor(saved, recompute), "");
      EXPECT_TRUE(same_shared_bits(saved, recompute));
    }
  }
}

TEST(LayerBackwardSaveMode, GraphOfForwardAndBackwardReplaysBitwise) {
  MOK_REQUIRE_HOPPER_GPUS(1);
  const Problem problem = layer_problem({"skewed:1.2", 0.1, true, true}, 200, 14, true);
  BackwardRun run;
  run.save = true;
  run.use_graph = true;  // run_gpu_backward throws if a replay differs from the eager run
  expect_matches_reference(problem, 1, run_gpu_backward(problem, 1, run), run);
}

TEST(LayerBackwardSaveMode, UnfusedForwardRefusesToSave) {
  MOK_REQUIRE_HOPPER_GPUS(1);
  LayerForwardOptions options;
  options.fused.enabled = false;
  LayerForward forward(local_communicators(1)[0], find_preset("tiny").shape, 64, options);
  SavedContext saved;
  try {
    forward.forward(nullptr, nullptr, nullptr, nullptr, 0, nullptr, nullptr, &saved);
    FAIL() << "the unfused forward accepted a context to save";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("save"), std::string::npos) << error.what();
  }
}

TEST(LayerBackwardEp1, RejectsTooManyTokensNamingTheArgument) {
  MOK_REQUIRE_HOPPER_GPUS(1);
  LayerBackward layer(local_communicators(1)[0], find_preset("tiny").shape, 64);
  try {
    layer.backward({}, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, {}, 65, nullptr);
    FAIL() << "65 tokens accepted with tokens_max 64";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("num_tokens"), std::string::npos) << error.what();
  }
}

// ---- EP = 2 -------------------------------------------------------------------------------------

class LayerBackwardEp2 : public ::testing::TestWithParam<Case> {};

TEST_P(LayerBackwardEp2, MatchesReferenceAndEp1Bitwise) {
  MOK_REQUIRE_HOPPER_GPUS(1);  // (EP 2 emulated on one GPU where there is one)
  const Problem problem = layer_problem(GetParam(), 2 * 173, 5, true);
  BackwardRun run;
  run.repeats = 1;
  const BackwardOutputs ep2 = run_gpu_backward(problem, 2, run);
  expect_matches_reference(problem, 2, ep2, run);
  const BackwardOutputs ep1 = run_gpu_backward(problem, 1, run);
  EXPECT_EQ(first_different_tensor(ep1, ep2), "") << "EP=1 differs from EP=2";
  BackwardRun save;
  save.save = true;
  EXPECT_EQ(first_different_tensor(run_gpu_backward(problem, 2, save), ep1), "")
      << "EP=2 save mode differs from EP=1 recompute";
}

// EP 4 and 8 (emulated on one GPU where there are fewer): the fused forward's y, and the
// save-mode backward's outputs, bitwise those of EP 1, with ring rounds and without. (EP 8
// emulated on one H200, 14 SMs a rank, had timed out before the tests loaded kernels eagerly:
// cuda_environment.cpp.)
TEST(LayerEpInvariance, Ep4And8EqualEp1Bitwise) {
  MOK_REQUIRE_HOPPER_GPUS(1);
  for (const Case& routing :
       {Case{"skewed:3", 0.1, true, true}, Case{"uniform", 0.0, false, true}}) {
    SCOPED_TRACE(case_name(routing));
    const Problem problem = layer_problem(routing, 8 * 37, 17);
    GpuRun fused;
    fused.layer.fused.enabled = true;
    const std::vector<bf16> y1 = run_gpu_layer(problem, 1, fused);
    BackwardRun save;
    save.save = true;
    const BackwardOutputs ep1 = run_gpu_backward(problem, 1, save);
    expect_matches_reference(problem, 1, ep1, save);
    for (int ep : {4, 8}) {
      SCOPED_TRACE("EP " + std::to_string(ep));
      GpuRun rounds = fused;
      rounds.layer.fused.ring_rows = static_cast<int64_t>(kMinRingRows);
      rounds.layer.fused.minibatch_rows = 128;
      // A device wait that times out throws: name the run it came from (an intermittent timeout
      // of this test is open, docs/perf-notes/reliability.md).
      const auto named = [&](const char* run, const auto& body) {
        try {
          body();
        } catch (const std::exception& error) {
          ADD_FAILURE() << case_name(routing) << ", EP " << ep << ", " << run << ": "
                        << error.what();
        }
      };
      named("forward, one round", [&] {
        EXPECT_EQ(first_difference(run_gpu_layer(problem, ep, fused), y1), -1) << "y, one round";
      });
      named("forward, ring rounds", [&] {
        EXPECT_EQ(first_difference(run_gpu_layer(problem, ep, rounds), y1), -1) << "y, ring rounds";
      });
      named("backward, save mode", [&] {
        EXPECT_EQ(first_different_tensor(run_gpu_backward(problem, ep, save), ep1), "")
            << "the backward";
      });
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Routings, LayerBackwardEp2,
                         ::testing::Values(Case{"uniform", 0.2, true, true},
                                           Case{"skewed:4", 0.0, false, true},
                                           Case{"single-expert", 0.0, false, false}),
                         [](const auto& info) { return case_name(info.param); });

}  // namespace
}  // namespace mok::comm_test
