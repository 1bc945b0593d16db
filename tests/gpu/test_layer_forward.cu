// The unfused GPU layer forward (LayerForward: schedule, dispatch, grouped SwiGLU and down GEMMs,
// shared expert, combine) against the CPU reference within bf16 tolerance, and its determinism
// contracts bitwise: EP=1 equals EP=2, repeats are equal, GEMM and copy SM counts do not change a
// bit, a replayed CUDA graph equals the eager run. Routings: uniform, skewed, all tokens to one
// expert, empty experts, -1 slots; token counts that are not multiples of 128.
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "mok/compare.hpp"
#include "runtime/device.hpp"
#include "runtime/layer_forward.hpp"
#include "routing_cases.hpp"
#include "test_comm_harness.cuh"

namespace mok::comm_test {
namespace {

#define MOK_REQUIRE_HOPPER_GPUS(count)                                                          \
  do {                                                                                          \
    const runtime::GpuSummary gpus_ = runtime::query_gpus();                                    \
    if (gpus_.num_hopper_gpus < (count)) {                                                      \
      GTEST_SKIP() << "needs " << (count) << " Hopper GPU(s) for the layer forward; found: "     \
                   << gpus_.description;                                                        \
    }                                                                                           \
  } while (0)

using testing::Case;
using testing::case_name;

// The tiny preset's shape, or H 512 and I 192: several K blocks and N tiles, a partial N tile.
Problem layer_problem(const Case& which, int64_t num_tokens, uint64_t seed, bool wider = false) {
  return testing::make_problem(which, num_tokens, seed,
                               wider ? LayerShape{512, 192, 64, 16, 6} : find_preset("tiny").shape);
}

struct GpuRun {
  LayerForwardOptions layer;
  int repeats = 1;          // eager runs after the first; each must give the first's bits
  bool use_graph = false;   // then also capture one forward and replay it twice
  int64_t extra_capacity = 0;
  // The weights live in the test's own device buffers, passed to every forward (the torch path);
  // the layer allocates none.
  bool callers_weights = false;
};

// y (T_global, H) of the problem computed by LayerForward at EP = `ep`. Every buffer a step
// writes is NaN-poisoned before each run, so an element nobody wrote shows.
std::vector<bf16> run_gpu_layer(const Problem& problem, int ep, const GpuRun& run) {
  const std::vector<Communicator>& comms = local_communicators(ep);
  const int64_t tokens = problem.num_tokens / ep, hidden = problem.shape.hidden;
  std::vector<bf16> y_all(static_cast<size_t>(problem.num_tokens * hidden));
  for_each_rank(ep, [&](int rank) {
    MOK_CUDA_CHECK(cudaSetDevice(comms[rank].device()));
    const reference::RankInputs inputs = problem.rank_inputs(rank, ep);
    LayerForwardOptions options = run.layer;
    options.allocate_weights = !run.callers_weights;
    LayerForward layer(comms[rank], problem.shape, tokens + run.extra_capacity, options);
    auto host = [](const auto& view) {
      return std::vector(view.data, view.data + view.numel());
    };
    const LayerWeights& w = inputs.weights;
    const LayerShape& shape = problem.shape;
    const int local_experts = static_cast<int>(w.gate.shape[0]);
    DeviceBuffer<bf16> gate_up(run.callers_weights ? gemm::interleave_gate_up(
                                                         host(w.gate), host(w.up), local_experts,
                                                         static_cast<int>(shape.intermediate),
                                                         static_cast<int>(shape.hidden))
                                                   : std::vector<bf16>{});
    DeviceBuffer<bf16> down(run.callers_weights ? host(w.down) : std::vector<bf16>{});
    const bool shared = run.callers_weights && shape.has_shared();
    DeviceBuffer<bf16> shared_gate_up(shared ? gemm::interleave_gate_up(
                                                   host(w.shared_gate), host(w.shared_up), 1,
                                                   static_cast<int>(shape.shared_intermediate),
                                                   static_cast<int>(shape.hidden))
                                             : std::vector<bf16>{});
    DeviceBuffer<bf16> shared_down(shared ? host(w.shared_down) : std::vector<bf16>{});
    DeviceLayerWeights callers;
    if (run.callers_weights) {
      callers = {gate_up.get(), down.get(), shared ? shared_gate_up.get() : nullptr,
                 shared ? shared_down.get() : nullptr,
                 static_cast<int64_t>(gate_up.size()), static_cast<int64_t>(down.size()),
                 shared ? static_cast<int64_t>(shared_gate_up.size()) : 0,
                 shared ? static_cast<int64_t>(shared_down.size()) : 0};
    } else {
      layer.load_weights(inputs.weights);
    }
    DeviceBuffer<bf16> x(host(inputs.tokens.x));                 // (T, H)
    DeviceBuffer<int32_t> topk_idx(host(inputs.tokens.topk_idx));  // (T, k)
    DeviceBuffer<float> topk_w(host(inputs.tokens.topk_w));       // (T, k)
    DeviceBuffer<bf16> y(static_cast<size_t>(tokens * hidden));   // (T, H)
    cudaStream_t stream = nullptr;
    MOK_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    CommWorkspace& ws = layer.workspace();
    const size_t row_bytes = static_cast<size_t>(ws.layout().row_bytes());
    const size_t rows = static_cast<size_t>(ws.layout().rows_capacity());
    auto poison = [&] {
      MOK_CUDA_CHECK(cudaMemsetAsync(y.get(), 0xff, y.size() * sizeof(bf16), stream));
      MOK_CUDA_CHECK(cudaMemsetAsync(ws.slots(), 0xff,
                                     ws.layout().tokens_max * ws.layout().top_k * row_bytes, stream));
      MOK_CUDA_CHECK(cudaMemsetAsync(ws.expert_x(), 0xff, rows * row_bytes, stream));
      MOK_CUDA_CHECK(cudaMemsetAsync(ws.expert_y(), 0xff, rows * row_bytes, stream));
    };
    auto enqueue = [&] {
      if (run.callers_weights) {
        layer.forward(callers, x.get(), topk_idx.get(), topk_w.get(), y.get(), tokens, stream);
      } else {
        layer.forward(x.get(), topk_idx.get(), topk_w.get(), y.get(), tokens, stream);
      }
    };
    auto expect_same = [&](const char* what, int index, const std::vector<bf16>& expected) {
      const int64_t differs = first_difference(y.download(), expected);
      MOK_CHECK_ARG(differs < 0, what, "rank ", rank, " run ", index,
                    " differs from the first eager run at element ", differs);
    };

    poison();
    enqueue();
    layer.check(stream);
    const std::vector<bf16> first = y.download();
    for (int repeat = 0; repeat < run.repeats; ++repeat) {
      poison();
      enqueue();
      layer.check(stream);
      expect_same("repeat", repeat, first);
    }
    if (run.use_graph) {
      cudaGraph_t graph = nullptr;
      cudaGraphExec_t graph_exec = nullptr;
      MOK_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
      enqueue();
      MOK_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
      MOK_CUDA_CHECK(cudaGraphInstantiate(&graph_exec, graph, 0));
      for (int replay = 0; replay < 2; ++replay) {
        poison();
        MOK_CUDA_CHECK(cudaGraphLaunch(graph_exec, stream));
        layer.check(stream);
        expect_same("graph replay", replay, first);
      }
      MOK_CUDA_CHECK(cudaGraphExecDestroy(graph_exec));
      MOK_CUDA_CHECK(cudaGraphDestroy(graph));
    }
    MOK_CUDA_CHECK(cudaStreamDestroy(stream));
    std::memcpy(y_all.data() + rank * tokens * hidden, first.data(), first.size() * sizeof(bf16));
  });
  return y_all;
}

// The GPU sums K in another order than the CPU reference, so the two agree to rounding: the GPU's
// error against the fp64 oracle must be within bf16 tolerance and within a small factor of the
// CPU reference's own error (same rounding points, FlashAttention's rule).
void expect_matches_reference(const Problem& problem, int ep, const std::vector<bf16>& y) {
  const std::vector<bf16> reference_output = reference_y(problem, ep);
  std::vector<double> oracle_y;
  for (const reference::OracleResult& rank :
       reference::oracle(problem.shape, problem.all_rank_inputs(ep), false)) {
    oracle_y.insert(oracle_y.end(), rank.y.begin(), rank.y.end());
  }
  const ErrorStats gpu = compare(y, oracle_y);
  const ErrorStats cpu = compare(reference_output, oracle_y);
  EXPECT_EQ(gpu.non_finite, 0) << "unwritten (NaN) elements in y";
  EXPECT_TRUE(gpu.within(kBf16Tolerance)) << "GPU vs oracle: " << gpu.describe();
  EXPECT_LE(gpu.relative_l2, 2.0 * cpu.relative_l2 + 1e-4)
      << "GPU vs oracle: " << gpu.describe() << "; CPU reference vs oracle: " << cpu.describe();
}


// ---- EP = 1 on one GPU ------------------------------------------------------------------------

TEST(LayerForwardEp1, MatchesReferenceAndRepeatsBitwise) {
  MOK_REQUIRE_HOPPER_GPUS(1);
  for (bool wider : {false, true}) {
    SCOPED_TRACE(wider ? "H 512, I 192, top-6" : "H 256, I 128, top-4");
    const Problem problem = layer_problem({"uniform", 0.1, true, true}, 300, 11, wider);  // 300 % 128 != 0
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
  MOK_REQUIRE_HOPPER_GPUS(2);
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
                      Case{"single-expert", 0.0, false, false},
                      Case{"uniform", 0.35, true, false}),
    [](const auto& info) { return case_name(info.param); });

TEST(LayerForwardEp2Settings, GemmAndCopySmCountsDoNotChangeABit) {
  MOK_REQUIRE_HOPPER_GPUS(2);
  const Problem problem = layer_problem({"skewed:1.2", 0.1, true, true}, 2 * 300, 21, true);
  std::vector<GpuRun> settings(4);
  settings[1].layer.gemm.num_sms = 37;
  settings[1].layer.copy = {5, comm::CopyMethod::kVector, 256};
  settings[2].layer.gemm.num_sms = 8;
  settings[2].layer.copy = {64, comm::CopyMethod::kVector, 512};
  settings[3].layer.overlap_shared_with_dispatch = false;  // shared expert, then dispatch
  settings.emplace_back().callers_weights = true;           // weights passed per call
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
  MOK_REQUIRE_HOPPER_GPUS(2);
  const Problem problem = layer_problem({"uniform", 0.2, true, true}, 2 * 250, 31, true);
  GpuRun run;
  run.use_graph = true;
  run.layer.copy = {8, comm::CopyMethod::kVector};
  expect_matches_reference(problem, 2, run_gpu_layer(problem, 2, run));
}

}  // namespace
}  // namespace mok::comm_test
