// Expert-parallel communication on two GPUs: the on-GPU schedule and dispatch against a host
// construction, and the whole dispatch -> reference expert -> combine path bitwise against the
// CPU reference at EP = 2, and EP = 1 against EP = 2, for several routings.
#include <gtest/gtest.h>

#include <string>

#include "routing_cases.hpp"
#include "test_comm_harness.cuh"

namespace mok::comm_test {
namespace {

using testing::Case;
using testing::case_name;
using testing::make_problem;

// ---- schedule + dispatch against the host's construction ------------------------------------

class CommDispatch : public ::testing::TestWithParam<std::string> {};

TEST_P(CommDispatch, RowsInGlobalTokenOrderWithPadding) {
  MOK_REQUIRE_GPUS(2);
  const int ep = 2;
  const Problem problem = make_problem({GetParam(), 0.2, false, false}, 384, 11);
  const LayerShape& shape = problem.shape;
  const int64_t tokens = problem.num_tokens / ep, hidden = shape.hidden, top_k = shape.top_k;
  const std::vector<Communicator>& comms = local_communicators(ep);
  WorkspaceOptions options;
  options.block_m = 64;
  for_each_rank(ep, [&](int rank) {
    MOK_CUDA_CHECK(cudaSetDevice(comms[rank].device()));
    CommWorkspace ws(comms[rank], shape, tokens + 5, options);  // T < T_max on purpose
    const int64_t experts_local = ws.layout().experts_per_rank();
    const int64_t capacity = ws.layout().rows_capacity();
    DeviceBuffer<int32_t> topk_idx(
        std::vector<int32_t>(problem.topk_idx.begin() + rank * tokens * top_k,
                             problem.topk_idx.begin() + (rank + 1) * tokens * top_k));
    MOK_CUDA_CHECK(cudaMemcpy(ws.x(), problem.x.data() + rank * tokens * hidden,
                              tokens * hidden * sizeof(bf16), cudaMemcpyHostToDevice));
    MOK_CUDA_CHECK(cudaMemset(ws.expert_x(), 0xff, capacity * hidden * sizeof(bf16)));
    schedule(ws, topk_idx.get(), tokens, nullptr);
    dispatch(ws, {8, 96}, nullptr);  // 3 warps per CTA
    ws.check(nullptr);

    std::vector<int32_t> offsets(experts_local + 1), row_source(capacity);
    std::vector<bf16> expert_x(capacity * hidden);
    MOK_CUDA_CHECK(cudaMemcpy(offsets.data(), ws.expert_offsets(), offsets.size() * 4,
                              cudaMemcpyDeviceToHost));
    MOK_CUDA_CHECK(cudaMemcpy(row_source.data(), ws.row_source(), row_source.size() * 4,
                              cudaMemcpyDeviceToHost));
    MOK_CUDA_CHECK(
        cudaMemcpy(expert_x.data(), ws.expert_x(), expert_x.size() * 2, cudaMemcpyDeviceToHost));

    int64_t expected_first = 0;
    for (int64_t local = 0; local < experts_local; ++local) {
      const int32_t expert = static_cast<int32_t>(rank * experts_local + local);
      ASSERT_EQ(offsets[local], expected_first) << "rank " << rank << " expert " << expert;
      int64_t row = expected_first;
      for (int64_t global = 0; global < problem.num_tokens; ++global) {  // global token order
        for (int64_t slot = 0; slot < top_k; ++slot) {
          if (problem.topk_idx[global * top_k + slot] != expert) continue;
          const int64_t source = global / tokens, token = global % tokens;
          const int32_t packed =
              static_cast<int32_t>((source * (tokens + 5) + token) * top_k + slot);
          ASSERT_EQ(row_source[row], packed)
              << "rank " << rank << " expert " << expert << " row " << row;
          ASSERT_EQ(0,
                    std::memcmp(&expert_x[row * hidden], &problem.x[global * hidden], hidden * 2))
              << "rank " << rank << " row " << row << " is not token " << global;
          ++row;
        }
      }
      const int64_t padded_end = expected_first + (row - expected_first + 63) / 64 * 64;
      for (; row < padded_end; ++row) ASSERT_EQ(row_source[row], -1) << "padding row " << row;
      expected_first = padded_end;
    }
    EXPECT_EQ(offsets[experts_local], expected_first);
  });
}

INSTANTIATE_TEST_SUITE_P(Routings, CommDispatch,
                         ::testing::Values("uniform", "skewed:2", "single-expert"),
                         [](const auto& info) {
                           std::string routing = info.param;
                           for (char& c : routing)
                             if (c == ':' || c == '-') c = '_';
                           return routing;
                         });

// ---- the whole path, bitwise ------------------------------------------------------------------

class CommLayer : public ::testing::TestWithParam<Case> {};

TEST_P(CommLayer, Ep2MatchesReferenceAndEp1Bitwise) {
  MOK_REQUIRE_GPUS(2);
  const Case which = GetParam();
  const Problem problem = make_problem(which, 256, 5);
  RunOptions options;
  options.copy = {6};
  options.extra_capacity = 3;
  const std::vector<bf16> expected = reference_y(problem, 2);
  const std::vector<bf16> ep2 = run_layer(problem, 2, options);
  EXPECT_EQ(first_difference(ep2, expected), -1) << "EP=2 differs from the CPU reference";
  const std::vector<bf16> ep1 = run_layer(problem, 1, options);
  EXPECT_EQ(first_difference(ep1, ep2), -1) << "EP=1 differs from EP=2";
  const std::vector<bf16> again = run_layer(problem, 2, options);
  EXPECT_EQ(first_difference(again, ep2), -1) << "a repeated EP=2 run differs";
}

INSTANTIATE_TEST_SUITE_P(Routings, CommLayer,
                         ::testing::Values(Case{"uniform", 0.0, false, true},
                                           Case{"skewed:1.5", 0.0, true, true},
                                           Case{"single-expert", 0.0, false, false},
                                           Case{"uniform", 0.35, true, false}),
                         [](const auto& info) { return case_name(info.param); });

TEST(CommLayerGraph, CapturedGraphReplaysEqualEagerAndReference) {
  MOK_REQUIRE_GPUS(2);
  const Problem problem = make_problem({"skewed:1.2", 0.1, true, true}, 256, 7);
  RunOptions options;
  options.copy = {4};
  options.use_graph = true;  // run_layer throws if a replay differs from the eager run
  const std::vector<bf16> y = run_layer(problem, 2, options);
  EXPECT_EQ(first_difference(y, reference_y(problem, 2)), -1);
}

TEST(CommLayerEp1, MatchesReferenceOnOneGpu) {
  MOK_REQUIRE_GPUS(1);
  const Problem problem = make_problem({"uniform", 0.1, false, true}, 128, 3);
  RunOptions options;
  options.copy = {4};
  EXPECT_EQ(first_difference(run_layer(problem, 1, options), reference_y(problem, 1)), -1);
}

// The dispatch by tokens (one rank alone) gives every row the pull gives: unused slots, a skewed
// routing, a single expert, and a replayed graph (poisoned rows before each run).
TEST(CommLayerEp1, DispatchByTokensMatchesReference) {
  MOK_REQUIRE_GPUS(1);
  for (const Case& routing : {Case{"skewed:2", 0.2, true, true}, Case{"uniform", 0.0, false, true},
                              Case{"single-expert", 0.0, false, false}}) {
    SCOPED_TRACE(case_name(routing));
    const Problem problem = make_problem(routing, 131, 5);
    RunOptions options;
    options.copy = {5};
    options.dispatch_by_tokens = true;
    options.use_graph = true;  // run_layer throws if a replay differs from the eager run
    EXPECT_EQ(first_difference(run_layer(problem, 1, options), reference_y(problem, 1)), -1);
  }
}

}  // namespace
}  // namespace mok::comm_test
