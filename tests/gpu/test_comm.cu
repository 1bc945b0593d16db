// Expert-parallel communication on two GPUs: the on-GPU schedule and dispatch against a host
// construction, and the whole dispatch -> reference expert -> combine path bitwise against the
// CPU reference at EP = 2, and EP = 1 against EP = 2, for several routings.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
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

// ---- the schedule on one GPU, against the host's construction -------------------------------

// The standalone schedule's sliced passes (count, scan, place) at EP 1 give offsets on block_m
// boundaries, each expert's rows in token then slot order, padding -1, and the row of every used
// slot (local_row: a backward workspace without expert_y, which the dispatch by tokens reads).
// The ids span 18 slices of kScheduleSlice, slice boundaries fall inside tokens' slots, ~10 % of
// the slots are unused, and there are fewer experts than a warp's lanes and more than a CTA's
// threads; the outputs are poisoned before each call, and a second call takes new ids.
TEST(CommSchedule, SlicedPassesPlaceRowsInTokenOrder) {
  MOK_REQUIRE_GPUS(1);
  const Communicator& comm = local_communicators(1)[0];
  MOK_CUDA_CHECK(cudaSetDevice(comm.device()));
  const int64_t tokens = 3001, top_k = 6, block_m = 64;
  static_assert(3001 * 6 > 17 * comm::kScheduleSlice, "the ids should span 18 slices");
  for (const int64_t experts : {8, 300}) {
    SCOPED_TRACE("experts " + std::to_string(experts));
    LayerShape shape;
    shape.hidden = 128;
    shape.intermediate = 128;
    shape.num_experts = experts;
    shape.top_k = top_k;
    WorkspaceOptions options;
    options.block_m = block_m;
    options.expert_y = false;
    options.backward = true;
    CommWorkspace ws(comm, shape, tokens + 7, options);  // T < T_max on purpose
    std::vector<double> weights(static_cast<size_t>(experts));
    for (int64_t e = 0; e < experts; ++e) weights[e] = 1.0 / std::pow(1.0 + e, 1.2);
    for (uint32_t call = 0; call < 2; ++call) {
      SCOPED_TRACE("call " + std::to_string(call));
      std::mt19937 rng(static_cast<uint32_t>(experts) * 7 + call);
      std::discrete_distribution<int32_t> skewed(weights.begin(), weights.end());
      std::bernoulli_distribution unused(0.1);
      std::vector<int32_t> ids(static_cast<size_t>(tokens * top_k));
      for (int64_t t = 0; t < tokens; ++t) {
        int32_t* row = ids.data() + t * top_k;
        for (int64_t j = 0; j < top_k; ++j) {
          do row[j] = skewed(rng);
          while (std::find(row, row + j, row[j]) != row + j);
        }
        for (int64_t j = 0; j < top_k; ++j) {
          if (unused(rng)) row[j] = -1;
        }
      }
      DeviceBuffer<int32_t> topk_idx(ids);
      const int64_t capacity = ws.layout().rows_capacity();
      MOK_CUDA_CHECK(cudaMemset(ws.view().row_source(), 0x7f, capacity * 4));
      MOK_CUDA_CHECK(cudaMemset(ws.view().local_row(), 0x7f, tokens * top_k * 4));
      MOK_CUDA_CHECK(cudaMemset(ws.view().offsets(), 0x7f, (experts + 1) * 4));
      schedule(ws, topk_idx.get(), tokens, nullptr);
      ws.check(nullptr);
      MOK_CUDA_CHECK(cudaDeviceSynchronize());
      auto download = [](const int32_t* device, int64_t count) {
        std::vector<int32_t> host(static_cast<size_t>(count));
        MOK_CUDA_CHECK(cudaMemcpy(host.data(), device, host.size() * 4, cudaMemcpyDeviceToHost));
        return host;
      };
      const std::vector<int32_t> offsets = download(ws.expert_offsets(), experts + 1);
      const std::vector<int32_t> counts = download(ws.expert_counts(), experts);
      const std::vector<int32_t> row_source = download(ws.row_source(), capacity);
      const std::vector<int32_t> local_row = download(ws.view().local_row(), tokens * top_k);
      int64_t first = 0, placed = 0;
      for (int64_t e = 0; e < experts; ++e) {
        ASSERT_EQ(offsets[e], first) << "expert " << e;
        int64_t row = first;
        for (int64_t index = 0; index < tokens * top_k; ++index) {  // token order, then slot
          if (ids[index] != e) continue;
          ASSERT_EQ(row_source[row], index) << "expert " << e << " row " << row;
          ASSERT_EQ(local_row[index], row)
              << "token " << index / top_k << " slot " << index % top_k;
          ++row;
        }
        ASSERT_EQ(counts[e], row - first) << "expert " << e;
        placed += row - first;
        const int64_t end = first + (row - first + block_m - 1) / block_m * block_m;
        for (; row < end; ++row) ASSERT_EQ(row_source[row], -1) << "padding row " << row;
        first = end;
      }
      EXPECT_EQ(offsets[experts], first);
      EXPECT_EQ(placed, std::count_if(ids.begin(), ids.end(), [](int32_t id) { return id >= 0; }));
    }
  }
}

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
