// Device-side faults in the communication path end in a host error naming rank, phase and cause,
// never in a hang: an expert id out of range or repeated in a row (in the standalone schedule
// kernels and in the fused forward's schedule), and a peer that never launches its half.
#include <gtest/gtest.h>

#include <barrier>
#include <cstdlib>
#include <functional>
#include <string>

#include "layer_test_support.cuh"
#include "test_comm_harness.cuh"

namespace mok::comm_test {
namespace {

Problem small_problem() {
  SyntheticSpec spec;
  spec.shape = find_preset("tiny").shape;
  spec.num_tokens = 128;
  spec.seed = 21;
  return Problem::generate(spec);
}

// (host only) A stalled rank's own error is not hidden behind its peers' timeouts: the first
// failure is rethrown as it was, every other one is written to stderr.
TEST(ForEachRank, RethrowsTheFirstFailureAndReportsTheOthers) {
  ::testing::internal::CaptureStderr();
  std::string thrown;
  try {
    for_each_rank(4, [](int rank) {
      if (rank == 1 || rank == 3) throw Error("test", "rank " + std::to_string(rank) + " stalled");
    });
  } catch (const Error& error) {
    thrown = error.what();
  }
  const std::string reported = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(thrown, "test: rank 1 stalled");
  EXPECT_NE(reported.find("rank 3 of 4 failed too: test: rank 3 stalled"), std::string::npos)
      << reported;
  EXPECT_EQ(reported.find("rank 1 stalled"), std::string::npos) << reported;
}

TEST(CommErrors, ExpertIdOutOfRangeBecomesHostError) {
  MOK_REQUIRE_GPUS(2);
  const Problem problem = small_problem();
  RunOptions options;
  options.copy = {4};
  options.workspace.timeout_ms = 2000;
  options.tamper = [&](int rank, int32_t* topk_idx) {
    if (rank != 1) return;
    const int32_t bad = 300;  // E = 16
    MOK_CUDA_CHECK(
        cudaMemcpy(topk_idx + 7 * problem.shape.top_k + 2, &bad, 4, cudaMemcpyHostToDevice));
  };
  try {
    run_layer(problem, 2, options);
    FAIL() << "an expert id of 300 with E = 16 was accepted";
  } catch (const Error& error) {
    const std::string message = error.what();
    EXPECT_EQ(error.argument(), "topk_idx") << message;
    EXPECT_NE(message.find("expert id 300 out of range [-1, 16) at rank 1 token 7 slot 2"),
              std::string::npos)
        << message;
  }
}

// Runs `call`, which must throw mok::Error about topk_idx with `fragment` in its message.
void expect_topk_idx_error(const std::function<void()>& call, const std::string& fragment) {
  try {
    call();
    ADD_FAILURE() << "accepted; expected an error with '" << fragment << "'";
  } catch (const Error& error) {
    const std::string message = error.what();
    EXPECT_EQ(error.argument(), "topk_idx") << message;
    EXPECT_NE(message.find(fragment), std::string::npos) << message;
  }
}

// The standalone schedule kernel (count_slices), at EP 2: a repeat on rank 1 is named by its rank,
// token and later slot, whichever rank finds it. Slots of -1 repeating are fine.
TEST(CommErrors, RepeatedExpertIdBecomesHostError) {
  MOK_REQUIRE_GPUS(2);
  const Problem problem = small_problem();
  const int64_t top_k = problem.shape.top_k, tokens_per_rank = problem.num_tokens / 2;
  const int32_t* row = problem.topk_idx.data() + (tokens_per_rank + 7) * top_k;  // rank 1, token 7
  RunOptions options;
  options.copy = {4};
  options.workspace.timeout_ms = 2000;
  options.tamper = [&](int rank, int32_t* topk_idx) {
    if (rank != 1) return;
    MOK_CUDA_CHECK(cudaMemcpy(topk_idx + 7 * top_k + 3, &row[1], 4, cudaMemcpyHostToDevice));
  };
  expect_topk_idx_error([&] { run_layer(problem, 2, options); },
                        detail::concat("expert id ", row[1],
                                       " repeated at rank 1 token 7 slot 3 "
                                       "(also at slot 1; the ids of a row must be distinct"));

  // Two unused slots in that row: accepted, and y is the CPU reference's.
  Problem unused_slots = problem;
  unused_slots.topk_idx[(tokens_per_rank + 7) * top_k + 1] = -1;
  unused_slots.topk_idx[(tokens_per_rank + 7) * top_k + 2] = -1;
  options.tamper = nullptr;
  std::vector<bf16> y;
  ASSERT_NO_THROW(y = run_layer(unused_slots, 2, options)) << "two -1 slots in a row were refused";
  EXPECT_EQ(first_difference(y, reference_y(unused_slots, 2)), -1);
}

// The fused forward makes the schedule in its kernel (comm::make_schedule, count_slices): the
// same check, on one GPU, also for a repeat that is not in adjacent slots.
TEST(CommErrors, RepeatedExpertIdInTheFusedForwardBecomesHostError) {
  MOK_REQUIRE_HOPPER_GPUS(1);
  const Problem problem = small_problem();
  const int64_t top_k = problem.shape.top_k, hidden = problem.shape.hidden;
  const Communicator& comm = local_communicators(1)[0];
  MOK_CUDA_CHECK(cudaSetDevice(comm.device()));
  LayerForwardOptions options;
  options.fused.enabled = true;
  options.fused.schedule_in_kernel = true;
  options.workspace.timeout_ms = 2000;
  LayerForward layer(comm, problem.shape, problem.num_tokens, options);
  layer.load_weights(problem.rank_inputs(0, 1).weights);
  std::vector<int32_t> ids = problem.topk_idx;
  ids[100 * top_k + 3] = ids[100 * top_k + 0];
  DeviceBuffer<bf16> x(problem.x);
  DeviceBuffer<int32_t> topk_idx(ids);
  DeviceBuffer<float> topk_w(problem.topk_w);
  DeviceBuffer<bf16> y(static_cast<size_t>(problem.num_tokens * hidden));
  expect_topk_idx_error(
      [&] {
        layer.forward(x.get(), topk_idx.get(), topk_w.get(), y.get(), problem.num_tokens, nullptr);
        layer.check(nullptr);
      },
      detail::concat("expert id ", ids[100 * top_k],
                     " repeated at rank 0 token 100 slot 3 (also at "
                     "slot 0; the ids of a row must be distinct, only -1 may repeat; found on the "
                     "device by rank 0, phase schedule)"));
}

TEST(CommErrors, MissingPeerTimesOutThenRecovers) {
  MOK_REQUIRE_GPUS(2);
  const Problem problem = small_problem();
  const std::vector<Communicator>& comms = local_communicators(2);
  const int64_t tokens = problem.num_tokens / 2, top_k = problem.shape.top_k;
  WorkspaceOptions options;
  options.timeout_ms = 300;
  std::barrier ranks_in_step(2);
  std::string message;
  for_each_rank(2, [&](int rank) {
    MOK_CUDA_CHECK(cudaSetDevice(comms[rank].device()));
    CommWorkspace ws(comms[rank], problem.shape, tokens, options);
    DeviceBuffer<int32_t> topk_idx(
        std::vector<int32_t>(problem.topk_idx.begin() + rank * tokens * top_k,
                             problem.topk_idx.begin() + (rank + 1) * tokens * top_k));
    if (rank == 0) {  // rank 1 never launches its half
      schedule(ws, topk_idx.get(), tokens, nullptr);
      try {
        ws.check(nullptr);
      } catch (const Error& error) {
        message = error.what();
      }
    }
    ranks_in_step.arrive_and_wait();
    ws.reset_after_error();
    ranks_in_step.arrive_and_wait();
    schedule(ws, topk_idx.get(), tokens, nullptr);  // both ranks now: works again
    rank_barrier(ws, nullptr);
    ws.check(nullptr);
  });
  EXPECT_NE(message.find("rank 0, phase gather: timed out after 300 ms waiting for rank 1's "
                         "gather flag to reach epoch 1"),
            std::string::npos)
      << "got: '" << message << "'";
}

// Emulated ranks refuse to start, naming the setting, without the environment that keeps their
// waits from blocking each other (tests/gpu/cuda_environment.cpp sets it; the check runs before
// any CUDA call, so this needs no GPU).
TEST(CommErrors, EmulationNamesAMissingEnvironmentSetting) {
  for (const char* name : {"CUDA_DEVICE_MAX_CONNECTIONS", "CUDA_MODULE_LOADING"}) {
    SCOPED_TRACE(name);
    const char* before = std::getenv(name);
    const std::string kept = before != nullptr ? before : "";
    setenv(name, "8", /*overwrite=*/1);
    std::string message;
    try {
      Communicator::emulate(0, 2);
    } catch (const Error& error) {
      message = error.what();
    }
    if (before != nullptr) {
      setenv(name, kept.c_str(), 1);
    } else {
      unsetenv(name);
    }
    EXPECT_NE(message.find(name), std::string::npos) << "got: '" << message << "'";
    EXPECT_NE(message.find("it is 8"), std::string::npos) << "got: '" << message << "'";
  }
}

}  // namespace
}  // namespace mok::comm_test
