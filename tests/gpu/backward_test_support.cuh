// The GPU layer backward's test harness (test_layer_backward.cu, test_layer_backward_fp8.cu): one
// backward per rank (bf16: LayerBackward, save or recompute mode; fp8: LayerBackwardFp8) on a
// Problem, every output NaN-poisoned (or, accumulating, set to a start value) before each run,
// every repeat and graph replay checked bitwise against the first run, the outputs gathered in
// global layout.
#pragma once

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "layer_test_support.cuh"
#include "runtime/layer_backward.hpp"
#include "runtime/layer_backward_fp8.hpp"
#include "runtime/layer_forward_fp8.hpp"

namespace mok::comm_test {

// Every output of one backward, in global layout (as ProblemOutputs): gate/up gradients split
// out of the interleaved (E, 2I, H) layout.
struct BackwardOutputs {
  std::vector<bf16> dx;
  std::vector<float> d_topk_w, grad_gate, grad_up, grad_down;
  std::vector<float> grad_shared_gate, grad_shared_up, grad_shared_down;  // (ep, ...)
};

inline bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// Index of the first tensor whose bits differ, as a name; empty when all match.
inline std::string first_different_tensor(const BackwardOutputs& a, const BackwardOutputs& b) {
  if (first_difference(a.dx, b.dx) >= 0 || a.dx.size() != b.dx.size()) return "dx";
  if (!same_bits(a.d_topk_w, b.d_topk_w)) return "d_topk_w";
  if (!same_bits(a.grad_gate, b.grad_gate)) return "grad_gate";
  if (!same_bits(a.grad_up, b.grad_up)) return "grad_up";
  if (!same_bits(a.grad_down, b.grad_down)) return "grad_down";
  return "";
}

// The routings of the save mode and chunked backward tests: uniform with unused slots, signed
// weights and a shared expert; skewed, most experts empty; every token on one expert.
inline const std::vector<Case> kBackwardRoutings = {{"uniform", 0.2, true, true},
                                                    {"skewed:4", 0.0, false, true},
                                                    {"single-expert", 0.0, true, false}};

struct BackwardRun {
  LayerBackwardOptions layer;
  int repeats = 1;  // runs after the first; each must give the first's bits
  bool use_graph = false;
  GradMode mode = GradMode::kOverwrite;
  float main_grad_start = 0.0f;  // kAccumulate: every gradient starts from this value
  // Save mode: each run is the forward (bf16: the fused one with these options; fp8:
  // LayerForwardFp8) keeping its context, then the backward reading it; otherwise the backward
  // alone, recomputing.
  bool save = false;
  FusedForwardOptions forward;
  // kFp8: LayerBackwardFp8 (layer's options and this pipeline), its weight cache made once before
  // the runs (and the save mode forward's own).
  Precision precision = Precision::kBf16;
  gemm::Fp8Pipeline fp8_pipeline{/*cluster=*/1, /*stages=*/0};
};

inline BackwardOutputs run_gpu_backward(const Problem& problem, int ep, const BackwardRun& run) {
  const std::vector<Communicator>& comms = test_communicators(ep);
  const LayerShape& shape = problem.shape;
  const int64_t tokens = problem.num_tokens / ep, hidden = shape.hidden;
  const int64_t inter = shape.intermediate, shared_inter = shape.shared_intermediate;
  const int64_t local_experts = shape.num_experts / ep;
  std::vector<BackwardOutputs> per_rank(ep);
  for_each_rank(ep, [&](int rank) {
    MOK_CUDA_CHECK(cudaSetDevice(comms[rank].device()));
    const reference::RankInputs inputs = problem.rank_inputs(rank, ep);
    const bool shared = shape.has_shared();
    const RankDeviceWeights device_weights(inputs.weights, shape);
    const DeviceLayerWeights weights = device_weights.view();
    DeviceBuffer<bf16> x(host_vector(inputs.tokens.x));
    DeviceBuffer<int32_t> topk_idx(host_vector(inputs.tokens.topk_idx));
    DeviceBuffer<float> topk_w(host_vector(inputs.tokens.topk_w));
    DeviceBuffer<bf16> dy(host_vector(inputs.dy));
    DeviceBuffer<bf16> dx(static_cast<size_t>(tokens * hidden));
    DeviceBuffer<float> d_topk_w(static_cast<size_t>(tokens * shape.top_k));
    DeviceBuffer<float> grad_gate_up(device_weights.gate_up.size()),
        grad_down(device_weights.down.size());
    DeviceBuffer<float> grad_shared_gate_up(device_weights.shared_gate_up.size()),
        grad_shared_down(device_weights.shared_down.size());
    DeviceLayerGradients grads{
        grad_gate_up.get(), grad_down.get(), shared ? grad_shared_gate_up.get() : nullptr,
        shared ? grad_shared_down.get() : nullptr,
        run.mode == GradMode::kAccumulate ? gemm::WgradOutput::kAccumulateFp32
                                          : gemm::WgradOutput::kFp32};
    cudaStream_t stream = nullptr;
    MOK_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    const bool fp8 = run.precision == Precision::kFp8;
    std::unique_ptr<LayerBackward> bf16_layer;
    std::unique_ptr<LayerBackwardFp8> fp8_layer;
    std::unique_ptr<Fp8WeightCache> fp8_weights;
    if (fp8) {
      fp8_layer = std::make_unique<LayerBackwardFp8>(
          comms[rank], shape, tokens, LayerBackwardFp8Options{run.layer, run.fp8_pipeline});
      fp8_weights = std::make_unique<Fp8WeightCache>(shape, local_experts, /*transposed=*/true);
      fp8_weights->quantize(weights, stream);
      MOK_CUDA_CHECK(cudaStreamSynchronize(stream));
    } else {
      bf16_layer = std::make_unique<LayerBackward>(comms[rank], shape, tokens, run.layer);
      // (not while a peer's kernels wait)
      if (!run.save) bf16_layer->allocate_recompute_buffers();
    }
    CommWorkspace& ws = fp8 ? fp8_layer->workspace() : bf16_layer->workspace();
    const RegisteredWorkspace registered(rank, "backward", ws);  // (for a timeout's report)
    const auto check = [&] { fp8 ? fp8_layer->check(stream) : bf16_layer->check(stream); };
    // Save mode: the forward that keeps the context, and the context (empty otherwise).
    std::unique_ptr<LayerForward> forward;
    std::unique_ptr<LayerForwardFp8> fp8_forward;
    if (run.save && fp8) {
      LayerForwardFp8Options options;
      options.layer.allocate_weights = false;
      options.pipeline = run.fp8_pipeline;
      fp8_forward = std::make_unique<LayerForwardFp8>(comms[rank], shape, tokens, options);
      fp8_forward->quantize_weights(weights, stream);
      MOK_CUDA_CHECK(cudaStreamSynchronize(stream));
    } else if (run.save) {
      LayerForwardOptions options;
      options.allocate_weights = false;
      options.fused = run.forward;
      forward = std::make_unique<LayerForward>(comms[rank], shape, tokens, options);
    }
    std::unique_ptr<RegisteredWorkspace> registered_forward;
    if (forward != nullptr || fp8_forward != nullptr) {
      registered_forward = std::make_unique<RegisteredWorkspace>(
          rank, "forward", forward != nullptr ? forward->workspace() : fp8_forward->workspace());
    }
    const int64_t save_tokens = run.save ? tokens : 0;
    DeviceBuffer<bf16> y(static_cast<size_t>(save_tokens * hidden));
    DeviceBuffer<bf16> saved_gate_up(static_cast<size_t>(
        saved_context_rows(ep, save_tokens, shape.top_k, save_tokens) * 2 * inter));
    DeviceBuffer<bf16> saved_shared_gate_up(
        static_cast<size_t>(shared ? save_tokens * 2 * shared_inter : 0));
    const SavedContext saved{saved_gate_up.get(), shared ? saved_shared_gate_up.get() : nullptr};
    auto prepare = [&] {  // poison every output (accumulate: start every gradient from a value)
      dx.poison();
      d_topk_w.poison();
      for (DeviceBuffer<float>* grad :
           {&grad_gate_up, &grad_down, &grad_shared_gate_up, &grad_shared_down}) {
        if (run.mode == GradMode::kAccumulate) {
          grad->upload(std::vector<float>(grad->size(), run.main_grad_start));
        } else {
          grad->poison();
        }
      }
      const size_t row_bytes = static_cast<size_t>(ws.layout().row_bytes());
      MOK_CUDA_CHECK(cudaMemset(ws.expert_y(), 0xff, ws.layout().expert_y_rows * row_bytes));
      MOK_CUDA_CHECK(cudaMemset(ws.expert_x(), 0xff, ws.layout().expert_rows * row_bytes));
      MOK_CUDA_CHECK(cudaMemset(ws.expert_dy(), 0xff, ws.layout().rows_capacity() * row_bytes));
      MOK_CUDA_CHECK(cudaMemset(ws.slots(), 0xff, ws.layout().slot_rows * row_bytes));
      MOK_CUDA_CHECK(
          cudaMemset(ws.d_topk_w(), 0xff, ws.layout().tokens_max * ws.layout().top_k * 4));
      if (run.save) {
        saved_gate_up.poison();
        saved_shared_gate_up.poison();
      }
      MOK_CUDA_CHECK(cudaDeviceSynchronize());
      // Ranks emulated on one GPU: none enqueues while another still synchronises the device.
      comms[rank].host_barrier();
    };
    auto enqueue = [&] {
      if (fp8_forward != nullptr) {
        fp8_forward->forward(x.get(), topk_idx.get(), topk_w.get(), y.get(), tokens, stream,
                             nullptr, &saved);
      } else if (run.save) {
        forward->forward(weights, x.get(), topk_idx.get(), topk_w.get(), y.get(), tokens, stream,
                         nullptr, &saved);
      }
      if (fp8) {
        fp8_layer->backward(*fp8_weights, x.get(), topk_idx.get(), topk_w.get(), dy.get(), dx.get(),
                            d_topk_w.get(), grads, tokens, stream, nullptr,
                            run.save ? &saved : nullptr);
      } else {
        bf16_layer->backward(weights, x.get(), topk_idx.get(), topk_w.get(), dy.get(), dx.get(),
                             d_topk_w.get(), grads, tokens, stream, nullptr,
                             run.save ? &saved : nullptr);
      }
    };
    auto collect = [&] {
      BackwardOutputs out;
      out.dx = dx.download();
      out.d_topk_w = d_topk_w.download();
      gemm::split_gate_up(grad_gate_up.download(), local_experts, inter, hidden, out.grad_gate,
                          out.grad_up);
      out.grad_down = grad_down.download();
      if (shared) {
        gemm::split_gate_up(grad_shared_gate_up.download(), 1, shared_inter, hidden,
                            out.grad_shared_gate, out.grad_shared_up);
        out.grad_shared_down = grad_shared_down.download();
      }
      return out;
    };
    // (prepare ends with the ranks' meeting: the host time named on a failure counts from there)
    prepare();
    run_and_check([] {}, enqueue,
                  [&] {
                    if (forward != nullptr) forward->check(stream);
                    if (fp8_forward != nullptr) fp8_forward->check(stream);
                    check();
                  });
    const BackwardOutputs first = collect();
    for (int repeat = 0; repeat < run.repeats; ++repeat) {
      prepare();
      run_and_check([] {}, enqueue, check);
      const std::string differs = first_different_tensor(collect(), first);
      MOK_CHECK_ARG(differs.empty(), "repeat", "rank ", rank, " run ", repeat, ": ", differs,
                    " differs from the first run");
    }
    if (run.use_graph) {
      replay_in_graph(stream, enqueue, 2, prepare, [&](int replay) {
        check();
        const std::string differs = first_different_tensor(collect(), first);
        MOK_CHECK_ARG(differs.empty(), "graph replay", "rank ", rank, " replay ", replay, ": ",
                      differs, " differs from the eager run");
      });
    }
    MOK_CUDA_CHECK(cudaStreamDestroy(stream));
    per_rank[rank] = first;
  });
  BackwardOutputs all;  // global layout: tokens and experts in rank order
  for (const BackwardOutputs& rank : per_rank) {
    auto append = [](auto& to, const auto& from) { to.insert(to.end(), from.begin(), from.end()); };
    append(all.dx, rank.dx);
    append(all.d_topk_w, rank.d_topk_w);
    append(all.grad_gate, rank.grad_gate);
    append(all.grad_up, rank.grad_up);
    append(all.grad_down, rank.grad_down);
    append(all.grad_shared_gate, rank.grad_shared_gate);
    append(all.grad_shared_up, rank.grad_shared_up);
    append(all.grad_shared_down, rank.grad_shared_down);
  }
  return all;
}

}  // namespace mok::comm_test
