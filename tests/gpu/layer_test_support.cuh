// Shared by the GPU layer forward suites (unfused and fused): the problems, one run of
// LayerForward on every rank with poisoned outputs and its determinism checks, and the comparison
// with the CPU reference.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "kernels/megakernel/trace.cuh"
#include "mok/compare.hpp"
#include "mok/gemm.hpp"
#include "mok/gpu.hpp"
#include "routing_cases.hpp"
#include "runtime/layer_forward.hpp"
#include "test_comm_harness.cuh"

namespace mok::comm_test {

#define MOK_REQUIRE_HOPPER_GPUS(count)                                                      \
  do {                                                                                      \
    const GpuSummary gpus_ = query_gpus();                                                  \
    if (gpus_.num_hopper_gpus < (count)) {                                                  \
      GTEST_SKIP() << "needs " << (count)                                                   \
                   << " Hopper GPU(s) for the layer forward; found: " << gpus_.description; \
    }                                                                                       \
  } while (0)

using testing::Case;
using testing::case_name;

// The communicators of an EP-`ep` test: one GPU per rank where there are enough Hopper GPUs, else
// `ep` ranks emulated on GPU 0 (Communicator::emulate: the same kernels, each rank on its share
// of the SMs), so that EP invariance is tested wherever one GPU is.
inline const std::vector<Communicator>& test_communicators(int ep) {
  if (ep == 1 || query_gpus().num_hopper_gpus >= ep) return local_communicators(ep);
  return emulated_communicators(ep);
}

// The tiny preset's shape, or H 512 and I 192: several K blocks and N tiles, a partial N tile.
inline Problem layer_problem(const Case& which, int64_t num_tokens, uint64_t seed,
                             bool wider = false) {
  return testing::make_problem(which, num_tokens, seed,
                               wider ? LayerShape{512, 192, 64, 16, 6} : find_preset("tiny").shape);
}

// A host copy of a tensor view's elements.
template <class View>
auto host_vector(const View& view) {
  return std::vector(view.data, view.data + view.numel());
}

// One rank's weights in the test's own device buffers, in the layouts of DeviceLayerWeights (gate
// and up interleaved in blocks of 8 rows): what a forward or backward given the caller's weights
// (the torch path) reads. upload false: empty buffers.
struct RankDeviceWeights {
  RankDeviceWeights(const LayerWeights& w, const LayerShape& shape, bool upload = true)
      : shared(upload && shape.has_shared()),
        gate_up(upload
                    ? gemm::interleave_gate_up(
                          host_vector(w.gate), host_vector(w.up), static_cast<int>(w.gate.shape[0]),
                          static_cast<int>(shape.intermediate), static_cast<int>(shape.hidden))
                    : std::vector<bf16>{}),
        down(upload ? host_vector(w.down) : std::vector<bf16>{}),
        shared_gate_up(
            shared ? gemm::interleave_gate_up(host_vector(w.shared_gate), host_vector(w.shared_up),
                                              1, static_cast<int>(shape.shared_intermediate),
                                              static_cast<int>(shape.hidden))
                   : std::vector<bf16>{}),
        shared_down(shared ? host_vector(w.shared_down) : std::vector<bf16>{}) {}

  DeviceLayerWeights view() const {
    return {gate_up.get(),
            down.get(),
            shared ? shared_gate_up.get() : nullptr,
            shared ? shared_down.get() : nullptr,
            static_cast<int64_t>(gate_up.size()),
            static_cast<int64_t>(down.size()),
            shared ? static_cast<int64_t>(shared_gate_up.size()) : 0,
            shared ? static_cast<int64_t>(shared_down.size()) : 0};
  }

  bool shared;  // (first: the buffers' initialisers read it)
  DeviceBuffer<bf16> gate_up, down, shared_gate_up, shared_down;
};

struct GpuRun {
  GpuRun() { layer.fused.enabled = false; }  // the unfused composition unless a test asks
  LayerForwardOptions layer;
  int repeats = 1;         // eager runs after the first; each must give the first's bits
  bool use_graph = false;  // then also capture one forward and replay it twice
  int64_t extra_capacity = 0;
  // The weights live in the test's own device buffers, passed to every forward (the torch path);
  // the layer allocates none.
  bool callers_weights = false;
  // The fused kernel records its per-CTA timeline (checked for sanity after the first run).
  bool trace = false;
  // Called on every rank (at once: it may be collective) after the first run's check, with the
  // rank's device topk_idx and token count.
  std::function<void(int rank, LayerForward& layer, cudaStream_t stream, const int32_t* topk_idx,
                     int64_t tokens)>
      after_first_run;
};

// y (T_global, H) of the problem computed by LayerForward at EP = `ep`. Every buffer a step
// writes is NaN-poisoned before each run, so an element nobody wrote shows.
// Every CTA started, ended after it started, and the CTAs ran some tasks between them.
inline void expect_sane_trace(const std::vector<uint64_t>& trace, int fields) {
  ASSERT_FALSE(trace.empty());
  uint64_t tasks = 0;
  for (size_t cta = 0; cta * fields < trace.size(); ++cta) {
    const uint64_t* record = &trace[cta * fields];
    EXPECT_GT(record[megakernel::kTraceStart], 0u) << "CTA " << cta;
    EXPECT_GE(record[megakernel::kTraceEnd], record[megakernel::kTraceStart]) << "CTA " << cta;
    EXPECT_GE(record[megakernel::kTraceTasksEnd], record[megakernel::kTraceScheduled])
        << "CTA " << cta;
    tasks += record[megakernel::kTraceTasks];
  }
  EXPECT_GT(tasks, 0u);
}

// The workspaces of the ranks a test runs now, for a failure's report of when each rank's last
// call began on the device (CommWorkspace::call_began_ns): a rank whose call began seconds after
// the others' was held before its first kernel (the EP 4/8 emulation fault,
// docs/perf-notes/reliability.md). A rank is listed while a RegisteredWorkspace of it lives.
class RankWorkspaces {
 public:
  static RankWorkspaces& instance() {
    static RankWorkspaces registry;
    return registry;
  }
  void add(int rank, const char* label, const CommWorkspace* workspace) {
    std::lock_guard<std::mutex> lock(mutex_);
    workspaces_[{rank, label}] = workspace;
  }
  void remove(int rank, const char* label, const CommWorkspace* workspace) {
    std::lock_guard<std::mutex> lock(mutex_);
    const auto found = workspaces_.find({rank, label});
    if (found != workspaces_.end() && found->second == workspace) workspaces_.erase(found);
  }
  // " [calls began, device clock after the earliest: rank 0 backward +0.0 ms, ...]", or how
  // many were listed when fewer than two.
  std::string describe_call_starts() {
    std::lock_guard<std::mutex> lock(mutex_);
    if (workspaces_.size() < 2) {
      return " [calls began: " + std::to_string(workspaces_.size()) + " workspace(s) listed]";
    }
    std::map<std::pair<int, std::string>, uint64_t> began;
    for (const auto& [key, workspace] : workspaces_) began[key] = workspace->call_began_ns();
    // (0: the call's first kernel has not run yet on that workspace)
    uint64_t earliest = UINT64_MAX;
    for (const auto& [key, ns] : began) {
      if (ns != 0) earliest = std::min(earliest, ns);
    }
    std::string text = " [calls began, device clock after the earliest:";
    for (const auto& [key, ns] : began) {
      char item[96];
      if (ns == 0) {
        std::snprintf(item, sizeof(item), " rank %d %s not begun", key.first, key.second.c_str());
      } else {
        std::snprintf(item, sizeof(item), " rank %d %s +%.1f ms", key.first, key.second.c_str(),
                      (ns - earliest) / 1e6);
      }
      text += item;
    }
    return text + "]";
  }

 private:
  std::mutex mutex_;
  std::map<std::pair<int, std::string>, const CommWorkspace*> workspaces_;
};

// Lists a rank's workspace (of its forward or backward layer: `label`) in RankWorkspaces for its
// lifetime.
class RegisteredWorkspace {
 public:
  RegisteredWorkspace(int rank, const char* label, const CommWorkspace& workspace)
      : rank_(rank), label_(label), workspace_(&workspace) {
    RankWorkspaces::instance().add(rank_, label_, workspace_);
  }
  ~RegisteredWorkspace() { RankWorkspaces::instance().remove(rank_, label_, workspace_); }
  RegisteredWorkspace(const RegisteredWorkspace&) = delete;
  RegisteredWorkspace& operator=(const RegisteredWorkspace&) = delete;

 private:
  int rank_;
  const char* label_;
  const CommWorkspace* workspace_;
};

// One run of a rank after the ranks met: prepare (poison), enqueue, then check (which throws a
// device fault). The ranks' threads enqueue one at a time (their kernels still wait for each other
// side by side on the device): with every thread launching at once, one rank's first kernel of a
// call at times began only when its peers' waits gave up, 13 of 75 runs of the EP 4/8 invariance
// test against 1 of 72 one at a time (docs/perf-notes/reliability.md). A failure's message adds
// how long this rank's prepare and launches took on the host after the meeting: a rank held there
// by a call that waits for the whole device shows seconds.
template <class Check>
void run_and_check(const std::function<void()>& prepare, const std::function<void()>& enqueue,
                   const Check& check) {
  const auto met = std::chrono::steady_clock::now();
  prepare();
  {
    static std::mutex launching;
    const std::lock_guard<std::mutex> lock(launching);
    enqueue();
  }
  const double host_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - met).count();
  try {
    check();
  } catch (const Error& error) {
    std::string message = error.what();
    const std::string prefix = error.argument().empty() ? "" : error.argument() + ": ";
    if (message.rfind(prefix, 0) == 0) message = message.substr(prefix.size());
    throw Error(error.argument(), message + " [this rank's launches were done " +
                                      std::to_string(static_cast<int64_t>(host_ms)) +
                                      " ms after the ranks met]" +
                                      RankWorkspaces::instance().describe_call_starts());
  }
}

// One rank's runs of a forward test: the first run (its outputs poisoned first), then `repeats`
// eager runs and, with use_graph, two replays of a captured forward, each of which must give the
// first run's y bitwise; returns the first run's y. after_first, when given, runs once after the
// first run. Ranks emulated on one GPU meet before each run: no rank enqueues while another still
// synchronises the device (setting up, or in after_first), which would wait for the first one's
// waiting kernels. Layer: anything with check(stream) (LayerForward, LayerForwardFp8).
template <class Layer>
std::vector<bf16> first_run_then_repeats(const Communicator& comm, int rank, cudaStream_t stream,
                                         const Layer& layer, const DeviceBuffer<bf16>& y,
                                         int repeats, bool use_graph,
                                         const std::function<void()>& poison,
                                         const std::function<void()>& enqueue,
                                         const std::function<void()>& after_first = {}) {
  auto expect_same = [&](const char* what, int index, const std::vector<bf16>& expected) {
    const int64_t differs = first_difference(y.download(), expected);
    MOK_CHECK_ARG(differs < 0, what, "rank ", rank, " run ", index,
                  " differs from the first eager run at element ", differs);
  };
  const auto check = [&] { layer.check(stream); };
  comm.host_barrier();
  run_and_check(poison, enqueue, check);
  const std::vector<bf16> first = y.download();
  if (after_first) after_first();
  for (int repeat = 0; repeat < repeats; ++repeat) {
    comm.host_barrier();
    run_and_check(poison, enqueue, check);
    expect_same("repeat", repeat, first);
  }
  if (use_graph) {
    comm.host_barrier();
    replay_in_graph(stream, enqueue, 2, poison, [&](int replay) {
      layer.check(stream);
      expect_same("graph replay", replay, first);
    });
  }
  return first;
}

inline std::vector<bf16> run_gpu_layer(const Problem& problem, int ep, const GpuRun& run) {
  const std::vector<Communicator>& comms = test_communicators(ep);
  const int64_t tokens = problem.num_tokens / ep, hidden = problem.shape.hidden;
  std::vector<bf16> y_all(static_cast<size_t>(problem.num_tokens * hidden));
  for_each_rank(ep, [&](int rank) {
    MOK_CUDA_CHECK(cudaSetDevice(comms[rank].device()));
    const reference::RankInputs inputs = problem.rank_inputs(rank, ep);
    LayerForwardOptions options = run.layer;
    options.allocate_weights = !run.callers_weights;
    LayerForward layer(comms[rank], problem.shape, tokens + run.extra_capacity, options);
    const RankDeviceWeights callers_weights(inputs.weights, problem.shape, run.callers_weights);
    DeviceLayerWeights callers;
    if (run.callers_weights) {
      callers = callers_weights.view();
    } else {
      layer.load_weights(inputs.weights);
    }
    DeviceBuffer<bf16> x(host_vector(inputs.tokens.x));                   // (T, H)
    DeviceBuffer<int32_t> topk_idx(host_vector(inputs.tokens.topk_idx));  // (T, k)
    DeviceBuffer<float> topk_w(host_vector(inputs.tokens.topk_w));        // (T, k)
    DeviceBuffer<bf16> y(static_cast<size_t>(tokens * hidden));           // (T, H)
    cudaStream_t stream = nullptr;
    MOK_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    CommWorkspace& ws = layer.workspace();
    const size_t row_bytes = static_cast<size_t>(ws.layout().row_bytes());
    auto poison = [&] {
      MOK_CUDA_CHECK(cudaMemsetAsync(y.get(), 0xff, y.size() * sizeof(bf16), stream));
      MOK_CUDA_CHECK(cudaMemsetAsync(ws.slots(), 0xff, ws.layout().slot_rows * row_bytes, stream));
      MOK_CUDA_CHECK(
          cudaMemsetAsync(ws.expert_x(), 0xff, ws.layout().expert_rows * row_bytes, stream));
      MOK_CUDA_CHECK(
          cudaMemsetAsync(ws.expert_y(), 0xff, ws.layout().expert_y_rows * row_bytes, stream));
      MOK_CUDA_CHECK(cudaMemsetAsync(layer.routed_hidden(), 0xff,
                                     ws.layout().expert_rows * problem.shape.intermediate * 2,
                                     stream));
    };
    auto enqueue = [&] {
      if (run.callers_weights) {
        layer.forward(callers, x.get(), topk_idx.get(), topk_w.get(), y.get(), tokens, stream);
      } else {
        layer.forward(x.get(), topk_idx.get(), topk_w.get(), y.get(), tokens, stream);
      }
    };
    if (run.trace) layer.enable_trace();
    const std::vector<bf16> first = first_run_then_repeats(
        comms[rank], rank, stream, layer, y, run.repeats, run.use_graph, poison, enqueue, [&] {
          if (run.trace) expect_sane_trace(layer.trace(stream), LayerForward::trace_fields());
          if (run.after_first_run) run.after_first_run(rank, layer, stream, topk_idx.get(), tokens);
        });
    MOK_CUDA_CHECK(cudaStreamDestroy(stream));
    std::memcpy(y_all.data() + rank * tokens * hidden, first.data(), first.size() * sizeof(bf16));
  });
  return y_all;
}

// The GPU sums K in another order than the CPU reference, so the two agree to rounding: the GPU's
// error against the fp64 oracle must be within bf16 tolerance and within a small factor of the
// CPU reference's own error (same rounding points, FlashAttention's rule).
inline void expect_matches_reference(const Problem& problem, int ep, const std::vector<bf16>& y) {
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

}  // namespace mok::comm_test
