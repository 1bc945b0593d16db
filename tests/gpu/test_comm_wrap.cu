// A caller's NCCL communicators (made from a unique id, one rank per host thread, as a PyTorch
// process group does it) wrapped by mok::Communicator::wrap run the same path with the same bits.
#include <gtest/gtest.h>

#include <nccl.h>

#include <vector>

#include "test_comm_harness.cuh"

namespace mok::comm_test {
namespace {

TEST(CommWrap, CallersCommunicatorsGiveTheReferenceBits) {
  MOK_REQUIRE_GPUS(2);
  constexpr int kRanks = 2;
  ncclUniqueId id;
  ASSERT_EQ(ncclGetUniqueId(&id), ncclSuccess);
  std::vector<ncclComm_t> raw(kRanks, nullptr);
  for_each_rank(kRanks, [&](int rank) {
    MOK_CUDA_CHECK(cudaSetDevice(rank));
    MOK_CHECK_ARG(ncclCommInitRank(&raw[rank], kRanks, id, rank) == ncclSuccess, "nccl",
                  "ncclCommInitRank failed on rank ", rank);
  });
  {
    std::vector<Communicator> comms;
    for (ncclComm_t comm : raw) comms.push_back(Communicator::wrap(comm));
    for (int rank = 0; rank < kRanks; ++rank) {
      EXPECT_EQ(comms[rank].rank(), rank);
      EXPECT_EQ(comms[rank].num_ranks(), kRanks);
      EXPECT_EQ(comms[rank].device(), rank);
    }
    SyntheticSpec spec{LayerShape{128, 64, 32, 16, 4}, 192, Routing::parse("skewed:1"), 17};
    const Problem problem = Problem::generate(spec);
    RunOptions options;
    options.copy = {4};
    const std::vector<bf16> y = run_layer(problem, comms, options);
    EXPECT_EQ(first_difference(y, reference_y(problem, kRanks)), -1)
        << "EP=2 over wrapped communicators differs from the CPU reference";
  }
  // mok never destroys a communicator it wrapped: the caller still owns (and here frees) them.
  for (ncclComm_t comm : raw) EXPECT_EQ(ncclCommDestroy(comm), ncclSuccess);
}

}  // namespace
}  // namespace mok::comm_test
