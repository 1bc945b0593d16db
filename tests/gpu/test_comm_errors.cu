// Device-side faults in the communication path end in a host error naming rank, phase and cause,
// never in a hang: an expert id out of range, and a peer that never launches its half.
#include <gtest/gtest.h>

#include <barrier>
#include <string>

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

TEST(CommErrors, ExpertIdOutOfRangeBecomesHostError) {
  MOK_REQUIRE_GPUS(2);
  const Problem problem = small_problem();
  RunOptions options;
  options.copy = {4, comm::CopyMethod::kVector};
  options.workspace.timeout_ms = 2000;
  options.tamper = [&](int rank, int32_t* topk_idx) {
    if (rank != 1) return;
    const int32_t bad = 300;  // E = 16
    MOK_CUDA_CHECK(cudaMemcpy(topk_idx + 7 * problem.shape.top_k + 2, &bad, 4, cudaMemcpyHostToDevice));
  };
  try {
    run_layer(problem, 2, options);
    FAIL() << "an expert id of 300 with E = 16 was accepted";
  } catch (const Error& error) {
    const std::string message = error.what();
    EXPECT_EQ(error.argument(), "topk_idx") << message;
    EXPECT_NE(message.find("expert id 300 out of range [-1, 16) at rank 1 token 7 slot 2"),
              std::string::npos) << message;
  }
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
    DeviceBuffer<int32_t> topk_idx(std::vector<int32_t>(
        problem.topk_idx.begin() + rank * tokens * top_k,
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
            std::string::npos) << "got: '" << message << "'";
}

}  // namespace
}  // namespace mok::comm_test
