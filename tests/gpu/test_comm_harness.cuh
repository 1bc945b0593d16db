// Shared pieces of the communication tests: device buffers, and one function that runs
// schedule -> dispatch -> reference experts -> combine for every rank of a synthetic problem.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "device_buffer.hpp"
#include "mok/cuda_check.hpp"
#include "mok/detail/numerics.hpp"
#include "mok/synthetic.hpp"
#include "runtime/comm.hpp"
#include "runtime/comm_ops.hpp"
#include "runtime/workspace.hpp"

namespace mok::comm_test {

inline int visible_gpus() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) return 0;
  return count;
}

#define MOK_REQUIRE_GPUS(count)                                                             \
  do {                                                                                      \
    const int visible_ = ::mok::comm_test::visible_gpus();                                  \
    if (visible_ < (count)) {                                                               \
      GTEST_SKIP() << "needs " << (count) << " GPU(s) for expert parallelism, " << visible_ \
                   << " visible";                                                           \
    }                                                                                       \
  } while (0)

using ::mok::testing::DeviceBuffer;

struct RunOptions {
  CopyConfig copy;
  bool use_graph = false;
  int graph_replays = 3;
  int64_t extra_capacity = 0;  // tokens_max = tokens per rank + this
  WorkspaceOptions workspace;
  // One rank: the rows copied by token (dispatch_tokens) instead of pulled by row (dispatch).
  bool dispatch_by_tokens = false;
  // Called on each rank after the inputs are on the device, before the run (e.g. to corrupt one).
  std::function<void(int rank, int32_t* topk_idx_device)> tamper;
};

// y (T_global, H) of the whole problem computed at EP = `ep`; a NaN-poisoned y shows unwritten
// elements. Throws what ws.check throws (the first rank's error).
std::vector<bf16> run_layer(const Problem& problem, int ep, const RunOptions& options);
// The same over the caller's communicators (one per rank, all in this process).
std::vector<bf16> run_layer(const Problem& problem, const std::vector<Communicator>& comms,
                            const RunOptions& options);

// The CPU reference's y at EP = `ep`.
std::vector<bf16> reference_y(const Problem& problem, int ep);

// Captures enqueue() on `stream` into a CUDA graph, then `replays` times: before(), a replay,
// after(replay).
inline void replay_in_graph(cudaStream_t stream, const std::function<void()>& enqueue, int replays,
                            const std::function<void()>& before,
                            const std::function<void(int)>& after) {
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t graph_exec = nullptr;
  MOK_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  enqueue();
  MOK_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  MOK_CUDA_CHECK(cudaGraphInstantiate(&graph_exec, graph, 0));
  for (int replay = 0; replay < replays; ++replay) {
    before();
    MOK_CUDA_CHECK(cudaGraphLaunch(graph_exec, stream));
    after(replay);
  }
  MOK_CUDA_CHECK(cudaGraphExecDestroy(graph_exec));
  MOK_CUDA_CHECK(cudaGraphDestroy(graph));
}

// Index of the first element whose bits differ, or -1.
int64_t first_difference(const std::vector<bf16>& a, const std::vector<bf16>& b);

}  // namespace mok::comm_test
