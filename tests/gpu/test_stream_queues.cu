// Emulated ranks (Communicator::emulate) rely on every rank's streams running beside every other
// rank's while kernels wait on peers. CUDA gives streams to the GPU's hardware queues
// (CUDA_DEVICE_MAX_CONNECTIONS of them, 32 in the GPU tests); two streams in one queue run one
// after the other, so a kernel queued behind a peer's waiting kernel waits until that one gives up
// (the EP 4/8 timeouts of docs/perf-notes/reliability.md). Here 8 ranks make 3 streams each, as
// the layer tests' ranks do (a test stream and two layers' side streams), round after round (each
// round's streams are made after the last round's were destroyed), and one kernel on every stream
// waits until all of them run: a stream that shares a queue with another shows as a timeout.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <thread>
#include <vector>

#include "kernels/ptx/special_registers.cuh"
#include "layer_test_support.cuh"

namespace mok::comm_test {
namespace {

constexpr uint64_t kMeetTimeoutNs = 2'000'000'000ull;

// One thread: counts itself in, then waits until `expected` kernels have (or the timeout), and
// records how many it saw.
__global__ void meet_kernel(unsigned* arrived, unsigned expected, unsigned* seen, int index) {
  if (threadIdx.x != 0) return;
  atomicAdd(arrived, 1u);
  const uint64_t start = ptx::global_timer_ns();
  unsigned count = 0;
  while ((count = atomicAdd(arrived, 0u)) < expected &&
         ptx::global_timer_ns() - start < kMeetTimeoutNs) {
    __nanosleep(1000);
  }
  seen[index] = count;
}

// Streams made `streams_per_rank` at a time by `ranks` threads at once (or, with one thread, one
// after the other), round after round: every stream's kernel meets all the others.
void expect_streams_side_by_side(int ranks, int streams_per_rank, bool from_rank_threads,
                                 int rounds) {
  const int num_streams = ranks * streams_per_rank;
  DeviceBuffer<unsigned> arrived(1), seen(static_cast<size_t>(num_streams));
  for (int round = 0; round < rounds; ++round) {
    SCOPED_TRACE("round " + std::to_string(round));
    MOK_CUDA_CHECK(cudaMemset(arrived.get(), 0, sizeof(unsigned)));
    MOK_CUDA_CHECK(cudaMemset(seen.get(), 0, seen.bytes()));
    MOK_CUDA_CHECK(cudaDeviceSynchronize());
    std::vector<cudaStream_t> streams(static_cast<size_t>(num_streams));
    const auto make = [&](int rank) {
      MOK_CUDA_CHECK(cudaSetDevice(0));
      for (int s = 0; s < streams_per_rank; ++s) {
        MOK_CUDA_CHECK(cudaStreamCreateWithFlags(&streams[rank * streams_per_rank + s],
                                                 cudaStreamNonBlocking));
      }
    };
    if (from_rank_threads) {
      std::vector<std::thread> threads;
      for (int rank = 0; rank < ranks; ++rank) threads.emplace_back(make, rank);
      for (std::thread& thread : threads) thread.join();
    } else {
      for (int rank = 0; rank < ranks; ++rank) make(rank);
    }
    for (int index = 0; index < num_streams; ++index) {
      meet_kernel<<<1, 32, 0, streams[index]>>>(arrived.get(), static_cast<unsigned>(num_streams),
                                                seen.get(), index);
      MOK_CUDA_CHECK_LAUNCH();
    }
    MOK_CUDA_CHECK(cudaDeviceSynchronize());
    // A kernel stuck behind another in one queue starts only once that one gave up: it alone
    // sees every kernel arrive, all the others give up one short.
    const std::vector<unsigned> counts = seen.download();
    std::string gave_up, late;
    for (int index = 0; index < num_streams; ++index) {
      const std::string name = " " + std::to_string(index / streams_per_rank) + "." +
                               std::to_string(index % streams_per_rank);
      (counts[index] == static_cast<unsigned>(num_streams) ? late : gave_up) += name;
    }
    EXPECT_TRUE(gave_up.empty()) << "streams (rank.stream) whose kernels gave up after 2 s:"
                                 << gave_up << "; saw every kernel:" << late
                                 << " (a kernel that waited in a shared hardware queue is there)";
    for (cudaStream_t stream : streams) MOK_CUDA_CHECK(cudaStreamDestroy(stream));
  }
}

TEST(EmulatedRanks, StreamsMadeByRankThreadsRunSideBySide) {
  MOK_REQUIRE_HOPPER_GPUS(1);
  expect_streams_side_by_side(/*ranks=*/8, /*streams_per_rank=*/3, /*from_rank_threads=*/true,
                              /*rounds=*/12);
}

TEST(EmulatedRanks, StreamsMadeInOneThreadRunSideBySide) {
  MOK_REQUIRE_HOPPER_GPUS(1);
  expect_streams_side_by_side(8, 3, /*from_rank_threads=*/false, 12);
}

// A stream that lives on while many more are made (a rank's test stream, a layer's side stream,
// a library's own) must still run beside each of them: if CUDA gave streams to the hardware
// queues in turn by creation count, some later stream would share the long-lived one's queue
// once more than CUDA_DEVICE_MAX_CONNECTIONS streams had been made. Each round makes
// kNewStreams streams, launches a meeting kernel on the long-lived stream and one on each new
// stream, and destroys the new ones; 12 rounds make 96 streams.
TEST(EmulatedRanks, StreamsMadeLaterRunBesideALongLivedOne) {
  MOK_REQUIRE_HOPPER_GPUS(1);
  constexpr int kNewStreams = 8;
  constexpr int kRounds = 12;
  constexpr unsigned kKernels = kNewStreams + 1;
  cudaStream_t long_lived = nullptr;
  MOK_CUDA_CHECK(cudaStreamCreateWithFlags(&long_lived, cudaStreamNonBlocking));
  DeviceBuffer<unsigned> arrived(1), seen(kKernels);
  std::string late_rounds;
  for (int round = 0; round < kRounds; ++round) {
    MOK_CUDA_CHECK(cudaMemset(arrived.get(), 0, sizeof(unsigned)));
    MOK_CUDA_CHECK(cudaMemset(seen.get(), 0, seen.bytes()));
    MOK_CUDA_CHECK(cudaDeviceSynchronize());
    std::vector<cudaStream_t> streams(kNewStreams);
    for (cudaStream_t& stream : streams) {
      MOK_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    }
    meet_kernel<<<1, 32, 0, long_lived>>>(arrived.get(), kKernels, seen.get(), 0);
    MOK_CUDA_CHECK_LAUNCH();
    for (int index = 0; index < kNewStreams; ++index) {
      meet_kernel<<<1, 32, 0, streams[index]>>>(arrived.get(), kKernels, seen.get(), index + 1);
      MOK_CUDA_CHECK_LAUNCH();
    }
    MOK_CUDA_CHECK(cudaDeviceSynchronize());
    const std::vector<unsigned> counts = seen.download();
    std::string gave_up, saw_all;
    for (unsigned index = 0; index < kKernels; ++index) {
      const std::string name = index == 0 ? " long-lived" : " new " + std::to_string(index - 1);
      (counts[index] == kKernels ? saw_all : gave_up) += name;
    }
    if (!gave_up.empty()) {
      late_rounds += "\n  round " + std::to_string(round) + " (streams " +
                     std::to_string(1 + round * kNewStreams + 1) + "-" +
                     std::to_string(1 + (round + 1) * kNewStreams) +
                     " made in this test), gave up:" + gave_up + "; saw every kernel:" + saw_all;
    }
    for (cudaStream_t stream : streams) MOK_CUDA_CHECK(cudaStreamDestroy(stream));
  }
  MOK_CUDA_CHECK(cudaStreamDestroy(long_lived));
  EXPECT_TRUE(late_rounds.empty())
      << "kernels that gave up after 2 s, and those that saw every kernel (a new stream queued "
         "behind the long-lived one starts once that gave up: it is among the latter):"
      << late_rounds;
}

}  // namespace
}  // namespace mok::comm_test
