// The fused forward (one persistent kernel for dispatch, the shared and routed expert GEMMs and
// the combine push) against the unfused composition bitwise, and through it against the CPU
// reference; EP=1 equals EP=2; ten repeats, graph replays and every setting of communication CTAs,
// minibatch, compute CTAs and ring size give the same bits (rings smaller than the received rows:
// several rounds). Routings: uniform, skewed, all tokens to one expert, empty experts, -1 slots;
// token counts that are not multiples of 128; small tails (swapped tail tiles).
#include <gtest/gtest.h>

#include <algorithm>
#include <vector>

#include "layer_test_support.cuh"

namespace mok::comm_test {
namespace {

GpuRun fused_run(int comm_ctas = 0, int minibatch_rows = 0, int compute_sms = 0,
                 int64_t ring_rows = 0) {
  GpuRun run;
  run.layer.fused.enabled = true;
  run.layer.fused.comm_ctas = comm_ctas;
  run.layer.fused.minibatch_rows = minibatch_rows;
  run.layer.fused.ring_rows = ring_rows;
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
  MOK_REQUIRE_HOPPER_GPUS(1);  // (EP 2 emulated on one GPU where there is one)
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
                      Case{"single-expert", 0.0, false, false}, Case{"uniform", 0.35, true, false}),
    [](const auto& info) { return case_name(info.param); });

// Ten eager repeats at EP 2 with the default settings, where the tickets, the dispatch order and
// the arrival of each peer's rows differ from run to run: every run gives the first's bits, and
// those are the unfused path's.
TEST(FusedForwardEp2Repeats, TenRepeatsGiveTheSameBits) {
  MOK_REQUIRE_HOPPER_GPUS(1);  // (EP 2 emulated on one GPU where there is one)
  const Problem problem = layer_problem({"skewed:1.2", 0.1, true, true}, 2 * 300, 47, true);
  GpuRun fused = fused_run();
  fused.repeats = 10;
  EXPECT_EQ(first_difference(run_gpu_layer(problem, 2, fused), run_gpu_layer(problem, 2, GpuRun{})),
            -1)
      << "fused differs from unfused";
}

TEST(FusedForwardEp2Settings, CommCtasMinibatchAndComputeCtasDoNotChangeABit) {
  MOK_REQUIRE_HOPPER_GPUS(1);  // (EP 2 emulated on one GPU where there is one)
  const Problem problem = layer_problem({"skewed:1.2", 0.1, true, true}, 2 * 300, 21, true);
  const std::vector<bf16> expected = run_gpu_layer(problem, 2, GpuRun{});  // unfused
  expect_matches_reference(problem, 2, expected);
  struct Setting {
    int comm_ctas, minibatch_rows, compute_sms;
  };
  // One row block per minibatch with a single communication CTA and 2 compute CTAs: the longest
  // task list and the most waiting; then wider settings up to the defaults (0 communication
  // CTAs: the producer warpgroups' spare warps dispatch), also on 3 CTAs only. (40: within the
  // 44 SMs of a rank's share when two ranks are emulated on one H200.)
  for (const Setting setting : {Setting{1, 128, 2}, Setting{5, 384, 37}, Setting{20, 4096, 0},
                                Setting{40, 100000, 0}, Setting{0, 128, 3}, Setting{0, 0, 0}}) {
    const GpuRun run = fused_run(setting.comm_ctas, setting.minibatch_rows, setting.compute_sms);
    EXPECT_EQ(first_difference(run_gpu_layer(problem, 2, run), expected), -1)
        << "comm CTAs " << setting.comm_ctas << ", minibatch rows " << setting.minibatch_rows
        << ", compute SMs " << setting.compute_sms << " differs from the unfused forward";
  }
  // The schedule made by a few CTAs (as few as the communication ones) while the rest start on
  // the shared gate/up tiles.
  for (const int schedule_ctas : {3, 17}) {
    GpuRun partial_schedule = fused_run(3, 256);
    partial_schedule.layer.fused.schedule_ctas = schedule_ctas;
    EXPECT_EQ(first_difference(run_gpu_layer(problem, 2, partial_schedule), expected), -1)
        << "the schedule on " << schedule_ctas << " CTAs differs from the unfused forward";
  }
  // Tickets from one pool for every CTA instead of a grant per L2 partition.
  GpuRun one_pool = fused_run(3, 256);
  one_pool.layer.fused.l2_partition_tickets = false;
  EXPECT_EQ(first_difference(run_gpu_layer(problem, 2, one_pool), expected), -1)
      << "tickets from one pool differ from the unfused forward";
  GpuRun separate_schedule = fused_run(3, 256);
  separate_schedule.layer.fused.schedule_in_kernel = false;  // the schedule's own kernels first
  EXPECT_EQ(first_difference(run_gpu_layer(problem, 2, separate_schedule), expected), -1)
      << "the fused kernel after the schedule kernels differs from the unfused forward";
  EXPECT_EQ(first_difference(run_gpu_layer(problem, 1, fused_run(2, 128, 5)), expected), -1)
      << "EP=1 differs from EP=2";
}

// Each rank receives ~1,800 rows (2 x 300 tokens x top-6 / 2 ranks, plus padding); rings of 256
// to 1,000 rows take them in 2 to 8 rounds, the dispatch waiting for slots the gate/up tiles
// have read and the gate/up tiles for hidden rows the down tiles have read.
TEST(FusedForwardEp2Rings, RingsSmallerThanTheReceivedRowsDoNotChangeABit) {
  MOK_REQUIRE_HOPPER_GPUS(1);  // (EP 2 emulated on one GPU where there is one)
  for (const Case& routing :
       {Case{"skewed:1.2", 0.1, true, true}, Case{"single-expert", 0.0, false, false}}) {
    SCOPED_TRACE(case_name(routing));
    const Problem problem = layer_problem(routing, 2 * 300, 41, true);
    const std::vector<bf16> expected = run_gpu_layer(problem, 2, GpuRun{});  // unfused
    expect_matches_reference(problem, 2, expected);
    struct Setting {
      int comm_ctas, minibatch_rows, compute_sms;
      int64_t ring_rows;
    };
    // The smallest ring (two blocks, one-block minibatches) with one communication CTA and two
    // compute CTAs: the most rounds and waits; a minibatch cut to half a ring that is no multiple
    // of it; a ring between the two.
    for (const Setting setting : {Setting{1, 128, 2, 256}, Setting{3, 4096, 0, 700},
                                  Setting{8, 256, 9, 1000}, Setting{0, 0, 0, 512}}) {
      GpuRun run = fused_run(setting.comm_ctas, setting.minibatch_rows, setting.compute_sms,
                             setting.ring_rows);
      run.repeats = 1;
      EXPECT_EQ(first_difference(run_gpu_layer(problem, 2, run), expected), -1)
          << "comm CTAs " << setting.comm_ctas << ", minibatch rows " << setting.minibatch_rows
          << ", compute SMs " << setting.compute_sms << ", ring rows " << setting.ring_rows
          << " differs from the unfused forward";
    }
    EXPECT_EQ(first_difference(run_gpu_layer(problem, 1, fused_run(2, 128, 5, 384)), expected), -1)
        << "EP=1 with a ring of 384 rows differs from EP=2 unfused";
  }
}

// The ring bounds the memory: the buffers shrink by what the ring leaves out of expert_x and the
// hidden rows (and the fused path holds no expert_y at all, the unfused one at EP 1 no slots).
TEST(FusedForwardEp1Rings, RingBoundsTheBuffers) {
  MOK_REQUIRE_HOPPER_GPUS(1);
  const LayerShape shape = find_preset("tiny").shape;
  const Communicator& comm = local_communicators(1)[0];
  MOK_CUDA_CHECK(cudaSetDevice(comm.device()));
  LayerForwardOptions unfused;
  unfused.fused.enabled = false;
  LayerForwardOptions full, ring;
  ring.fused.ring_rows = 1024;
  const int64_t tokens = 4096;
  const int64_t unfused_bytes = LayerForward(comm, shape, tokens, unfused).buffer_bytes();
  const int64_t full_bytes = LayerForward(comm, shape, tokens, full).buffer_bytes();
  const int64_t ring_bytes = LayerForward(comm, shape, tokens, ring).buffer_bytes();
  const int64_t capacity =
      LayerForward(comm, shape, tokens, full).workspace().layout().rows_capacity();
  const int64_t row = shape.hidden * 2;
  // (and at EP 1 the unfused path, which reads every row in its expert_y, holds no combine slots)
  EXPECT_EQ(unfused_bytes - full_bytes, capacity * row - tokens * shape.top_k * row)
      << "the fused path holds an expert_y, or the unfused one combine slots";
  EXPECT_GE(full_bytes - ring_bytes, (capacity - 1024) * (row + shape.intermediate * 2) - 8192)
      << "the ring does not bound expert_x and the hidden rows";
  LayerForwardOptions too_small;
  too_small.fused.ring_rows = 200;
  EXPECT_THROW(LayerForward(comm, shape, tokens, too_small), Error);
}

// The fused schedule (slice counts, their scan, placement: token_schedule.cuh, between grid
// barriers) gives the rows of the standalone schedule's kernels bitwise: the same offsets, counts,
// rows in global token order within each expert, and padding (CommSchedule checks those against
// the host's construction). Over several routings, token counts that are not
// multiples of the slice, and slice boundaries inside a token's slots (T k = 300 * 6).
TEST(FusedForwardEp2Schedule, PlacesRowsAsTheOrderedSchedule) {
  MOK_REQUIRE_HOPPER_GPUS(1);  // (EP 2 emulated on one GPU where there is one)
  for (const Case& routing :
       {Case{"skewed:1.2", 0.1, true, true}, Case{"uniform", 0.0, false, true},
        Case{"single-expert", 0.0, false, false}}) {
    SCOPED_TRACE(case_name(routing));
    const Problem problem = layer_problem(routing, 2 * 300, 51, true);
    GpuRun run = fused_run(3, 256);
    std::vector<int> checked(2, 0);
    std::vector<int64_t> rows(2, 0);  // each rank's (all tokens to one expert: rank 1 gets none)
    run.after_first_run = [&](int rank, LayerForward& layer, cudaStream_t stream,
                              const int32_t* topk_idx, int64_t tokens) {
      CommWorkspace& ws = layer.workspace();
      const int64_t experts = ws.layout().experts_per_rank();
      auto download = [&](const int32_t* device, int64_t count) {
        std::vector<int32_t> host(static_cast<size_t>(count));
        MOK_CUDA_CHECK(cudaMemcpy(host.data(), device, host.size() * 4, cudaMemcpyDeviceToHost));
        return host;
      };
      const std::vector<int32_t> offsets = download(ws.view().offsets(), experts + 1);
      const std::vector<int32_t> counts = download(ws.view().counts(), experts);
      const std::vector<int32_t> placed = download(ws.view().row_source(), offsets[experts]);
      MOK_CUDA_CHECK(cudaMemset(ws.view().row_source(), 0x7f, ws.layout().rows_capacity() * 4));
      schedule(ws, topk_idx, tokens, stream);  // the standalone kernels
      ws.check(stream);
      rows[rank] = offsets[experts];
      EXPECT_EQ(download(ws.view().offsets(), experts + 1), offsets) << "rank " << rank;
      EXPECT_EQ(download(ws.view().counts(), experts), counts) << "rank " << rank;
      EXPECT_EQ(download(ws.view().row_source(), offsets[experts]), placed) << "rank " << rank;
      checked[rank] = 1;
    };
    const std::vector<bf16> y = run_gpu_layer(problem, 2, run);
    EXPECT_EQ(checked, std::vector<int>({1, 1}));
    EXPECT_GT(rows[0] + rows[1], 0) << "no rank received rows: nothing was compared";
    EXPECT_EQ(first_difference(y, run_gpu_layer(problem, 2, GpuRun{})), -1)
        << "fused differs from unfused";
  }
}

// Experts whose last row block holds a few rows have them carried by the tiles of the blocks
// before it, 8 rows each (gemm/carried_tail.cuh, wgmma N over the rows); the others run half or
// full tiles. Counts around those edges (tails of 1, 2, 8, 9, 16 and 17 rows after one, two and
// three blocks, an empty expert, small experts), on the wider shape (a partial column block),
// give the unfused path's bits at EP1 (one minibatch) and EP2 (minibatches of two blocks, which
// some experts straddle), and match the CPU reference.
TEST(FusedForwardTails, CarriedTailsEqualUnfusedBitwise) {
  MOK_REQUIRE_HOPPER_GPUS(1);
  const int64_t tokens = 2 * 240;
  Problem problem = layer_problem({"uniform", 0.0, true, true}, tokens, 41, true);
  const std::vector<int> counts = {1,   5,   16,  17,  265, 400, 136, 64,
                                   401, 129, 144, 130, 164, 0,   3,   264};
  ASSERT_EQ(counts.size(), static_cast<size_t>(problem.shape.num_experts));
  // Expert e's slots are consecutive places of the list, so they fall on distinct tokens.
  const int64_t top_k = problem.shape.top_k;
  std::fill(problem.topk_idx.begin(), problem.topk_idx.end(), -1);
  int64_t place = 0;
  for (size_t e = 0; e < counts.size(); ++e) {
    for (int c = 0; c < counts[e]; ++c, ++place) {
      problem.topk_idx[(place % tokens) * top_k + place / tokens] = static_cast<int32_t>(e);
    }
  }
  ASSERT_LE(place, tokens * top_k);
  const std::vector<bf16> ep1 = run_gpu_layer(problem, 1, fused_run());
  expect_matches_reference(problem, 1, ep1);
  EXPECT_EQ(first_difference(run_gpu_layer(problem, 1, GpuRun{}), ep1), -1)
      << "fused differs from unfused";
  EXPECT_EQ(first_difference(run_gpu_layer(problem, 2, fused_run(2, 256)), ep1), -1)
      << "EP=2 differs from EP=1";
}

TEST(FusedForwardEp2Graph, GraphReplayEqualsEagerAndUnfused) {
  MOK_REQUIRE_HOPPER_GPUS(1);  // (EP 2 emulated on one GPU where there is one)
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
