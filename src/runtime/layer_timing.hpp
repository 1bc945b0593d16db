// What run_layer_forward (layer_runner.cu) runs and times on one rank: the warm-up, timed
// forwards, timed forward + backward pairs and the backward in both context modes, in bf16 and in
// an FP8 mode (fp8 or mxfp8: the same steps on the mode's layer objects). Internal to the runner.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <barrier>
#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "mok/cuda_check.hpp"
#include "mok/device_buffer.hpp"
#include "mok/layer_runner.hpp"
#include "runtime/comm.hpp"
#include "runtime/device_memory.hpp"
#include "runtime/layer_backward.hpp"
#include "runtime/layer_forward.hpp"

namespace mok::runtime {

// Uniform values in [-scale·√3, scale·√3) (standard deviation `scale`) from a counter-based hash of
// (seed, stream, index): the same on every GPU and in every run.
void fill_random(bf16* out, int64_t count, double scale, uint64_t seed, uint64_t stream);

// The middle value (of an even count, the upper of the two); 0 for none.
template <class T>
double median(std::vector<T> values) {
  std::sort(values.begin(), values.end());
  return values.empty() ? 0.0 : values[values.size() / 2];
}

// The ranks' warm-up beyond spec.warmup forwards: rounds of 4 forwards on every rank until rank 0
// has spent spec.warmup_ms warming up. The ranks must run the same number (a forward at EP > 1
// waits for its peers'), so rank 0 decides and the others follow through a host barrier.
class WarmUp {
 public:
  explicit WarmUp(int ranks) : barrier_(ranks) {}

  template <typename Forward>
  void run(const LayerRunSpec& spec, int rank, cudaStream_t stream, const Forward& forward) {
    const auto start = std::chrono::steady_clock::now();
    for (int iteration = 0; iteration < spec.warmup; ++iteration) forward();
    if (spec.warmup_ms <= 0) return;
    try {
      for (;;) {
        for (int iteration = 0; iteration < 4; ++iteration) forward();
        MOK_CUDA_CHECK(cudaStreamSynchronize(stream));
        if (rank == 0) {
          const std::chrono::duration<double, std::milli> spent =
              std::chrono::steady_clock::now() - start;
          more_.store(spent.count() < spec.warmup_ms);
        }
        barrier_.arrive_and_wait();  // every rank's round done, rank 0's decision made
        const bool more = more_.load();
        barrier_.arrive_and_wait();  // read by every rank before rank 0 decides again
        if (!more) return;
      }
    } catch (...) {
      more_.store(false);  // the others stop after their round
      barrier_.arrive_and_drop();
      throw;
    }
  }

 private:
  std::barrier<> barrier_;
  std::atomic<bool> more_{true};
};

// What run_backward measures on one rank, per context mode.
struct BackwardTiming {
  double backward_ms = 0, pair_ms = 0;
  std::vector<double> phase_ms;
};

// The median of spec.iterations forwards, each between events on `stream` (no host sync between
// them), and of each of its kNumForwardPhases phases. forward(marks): one forward recording
// kNumForwardPhases + 1 events.
struct ForwardTiming {
  double ms = 0;
  std::vector<double> phase_ms;
};

ForwardTiming time_forwards(const LayerRunSpec& spec, int rank, const std::string& loop,
                            cudaStream_t stream,
                            const std::function<void(const cudaEvent_t*)>& forward);

// spec.timed_loop's call for `loop` (rank 0 only): begin, or end once its work has finished.
inline void mark_timed_loop(const LayerRunSpec& spec, int rank, const std::string& loop,
                            bool begin) {
  if (rank == 0 && spec.timed_loop) spec.timed_loop(loop, begin);
}

// One rank's backward inputs and outputs: dy (the problem's, or seeded random values), dx,
// d_topk_w and the weight gradients in `output` (fp32-sized buffers: any output fits).
struct BackwardBuffers {
  BackwardBuffers(const LayerRunSpec& spec, int rank, const DeviceLayerWeights& weights,
                  gemm::WgradOutput output);

  DeviceBuffer<bf16> dy, dx;
  DeviceBuffer<float> d_topk_w, grad_gate_up, grad_down, grad_shared_gate_up, grad_shared_down;
  DeviceLayerGradients grads;
};

// Warms up and times spec.iterations training-step pairs on `stream`: pair(marks) enqueues one,
// recording marks[0] before its first step and the backward's kNumBackwardPhases + 1 phase marks
// at marks[1 ..], its phases in `order` (marks null: no events); check() waits and throws a
// device fault. `loop` names the timed pairs for spec.timed_loop. phases false: pair records
// marks[0], marks[1] and the last mark alone (a backward without phase marks), phase times 0.
template <class Pair, class Check>
BackwardTiming time_pairs(const LayerRunSpec& spec, int rank, const std::string& loop,
                          cudaStream_t stream, WarmUp& warm_up, const BackwardPhaseOrder& order,
                          const Pair& pair, const Check& check, bool phases = true) {
  warm_up.run(spec, rank, stream, [&] { pair(nullptr); });
  check();
  constexpr int kMarks = kNumBackwardPhases + 2;
  std::vector<cudaEvent_t> events(static_cast<size_t>(spec.iterations) * kMarks);
  for (cudaEvent_t& event : events) MOK_CUDA_CHECK(cudaEventCreate(&event));
  mark_timed_loop(spec, rank, loop, true);
  for (int iteration = 0; iteration < spec.iterations; ++iteration) {
    pair(&events[static_cast<size_t>(iteration) * kMarks]);
  }
  check();
  mark_timed_loop(spec, rank, loop, false);
  std::vector<float> backward_times(spec.iterations), pair_times(spec.iterations);
  std::vector<std::vector<float>> phase_times(kNumBackwardPhases, backward_times);
  for (int iteration = 0; iteration < spec.iterations; ++iteration) {
    const cudaEvent_t* marks = &events[static_cast<size_t>(iteration) * kMarks];
    MOK_CUDA_CHECK(cudaEventElapsedTime(&backward_times[iteration], marks[1], marks[kMarks - 1]));
    MOK_CUDA_CHECK(cudaEventElapsedTime(&pair_times[iteration], marks[0], marks[kMarks - 1]));
    for (int step = 0; step < kNumBackwardPhases && phases; ++step) {
      const int phase = static_cast<int>(order[step]);
      MOK_CUDA_CHECK(
          cudaEventElapsedTime(&phase_times[phase][iteration], marks[1 + step], marks[2 + step]));
    }
  }
  for (cudaEvent_t event : events) cudaEventDestroy(event);
  BackwardTiming timing;
  timing.backward_ms = median(backward_times);
  timing.pair_ms = median(pair_times);
  timing.phase_ms.resize(kNumBackwardPhases);
  for (int phase = 0; phase < kNumBackwardPhases; ++phase)
    timing.phase_ms[phase] = median(phase_times[phase]);
  return timing;
}

// The FP8 mode's training step's timings on one rank: save mode (the forward keeps the context)
// from the weights' quantization on, the same on cached weights, and recompute mode.
struct Fp8StepTimings {
  BackwardTiming save, cached, recompute;
};

// What the FP8 mode's layer measured on one rank (spec.fp8_forward; the step's with
// spec.backward).
struct Fp8RankTimings {
  double quantize_ms = 0;  // the weights into the cache, once
  ForwardTiming forward;
  Fp8StepTimings steps;
  int64_t buffer_bytes = 0, weight_bytes = 0, backward_buffer_bytes = 0, context_bytes = 0;
};

// The FP8 mode's training step on one rank (spec.fp8_forward and spec.backward): the weights
// quantized into the forward's cache (both layouts), the forward, the mode's backward (Backward:
// LayerBackwardFp8 or LayerBackwardMxfp8) on a dy as run_backward's, bf16 weight gradients; warmed
// up and timed as run_backward's pairs, each pair from the weights' quantization (an optimizer
// step changes them every step) to the backward's end, in save mode (the forward keeps its context
// for the backward) and in recompute mode; and the save mode pairs on the cached weights: a
// gradient-accumulation step after the first, whose weights have not changed since the last
// quantization. Save mode's dx and d_topk_w into result.fp8_dx, fp8_d_topk_w (keep_y).
template <class Backward, class Forward>
void run_fp8_backward(const LayerRunSpec& spec, int rank, const Communicator& comm,
                      Forward& forward_layer, const DeviceLayerWeights& weights, const bf16* x,
                      const int32_t* topk_idx, const float* topk_w, bf16* y, cudaStream_t stream,
                      WarmUp& warm_up, Fp8RankTimings& timings, LayerRunResult& result) {
  const LayerShape& shape = spec.shape;
  const int64_t tokens = spec.tokens_per_rank;
  Backward layer(comm, shape, tokens);
  timings.backward_buffer_bytes = layer.buffer_bytes();
  BackwardBuffers io(spec, rank, weights, gemm::WgradOutput::kBf16);
  DeviceBuffer<bf16> saved_gate_up(saved_context_rows(spec.ep, tokens, shape.top_k, tokens) * 2 *
                                   shape.intermediate);
  DeviceBuffer<bf16> saved_shared_gate_up(tokens * 2 * shape.shared_intermediate);
  timings.context_bytes =
      static_cast<int64_t>(saved_gate_up.bytes() + saved_shared_gate_up.bytes());
  const SavedContext context{saved_gate_up.get(),
                             shape.has_shared() ? saved_shared_gate_up.get() : nullptr};
  // One step: the weights quantized (or cached), the forward, the backward; save mode (saved: the
  // context) or recompute mode (null).
  const auto step = [&](bool quantize, const SavedContext* saved, const cudaEvent_t* marks) {
    if (marks != nullptr) MOK_CUDA_CHECK(cudaEventRecord(marks[0], stream));
    if (quantize) forward_layer.quantize_weights(weights, stream);
    forward_layer.forward(x, topk_idx, topk_w, y, tokens, stream, nullptr, saved);
    layer.backward(forward_layer.weight_cache(), x, topk_idx, topk_w, io.dy.get(), io.dx.get(),
                   io.d_topk_w.get(), io.grads, tokens, stream,
                   marks != nullptr ? marks + 1 : nullptr, saved);
  };
  const auto check = [&] {
    forward_layer.check(stream);
    layer.check(stream);
  };
  const std::string mode(precision_name(spec.fp8_precision));
  const auto time_steps = [&](bool quantize, const SavedContext* saved, const char* loop) {
    return time_pairs(
        spec, rank, mode + loop, stream, warm_up, layer.phase_order(),
        [&](const cudaEvent_t* marks) { step(quantize, saved, marks); }, check);
  };
  timings.steps.recompute = time_steps(true, nullptr, "-fwdbwd-recompute");
  timings.steps.cached = time_steps(false, &context, "-fwdbwd-cached");
  timings.steps.save = time_steps(true, &context, "-fwdbwd");  // last: its outputs are kept
  if (!spec.keep_y) return;
  io.dx.download(result.fp8_dx.data() + rank * tokens * shape.hidden);
  io.d_topk_w.download(result.fp8_d_topk_w.data() + rank * tokens * shape.top_k);
}

// The forward in the FP8 mode on one rank (spec.fp8_forward), after the bf16 one: `layer`
// (LayerForwardFp8 or LayerForwardMxfp8, made with the dgrads' layout when spec.backward) quantizes
// the weights once (timed), then is warmed up and timed as the bf16 forward is (no stale-rows
// forward first: neither mode's GEMMs read padding rows); its y into result.fp8_y (keep_y). With
// spec.backward, then run_fp8_backward with the mode's backward layer (Backward).
template <class Backward, class Forward>
void run_fp8_forward(const LayerRunSpec& spec, int rank, const Communicator& comm, Forward& layer,
                     const DeviceLayerWeights& weights, const bf16* x, const int32_t* topk_idx,
                     const float* topk_w, bf16* y, cudaStream_t stream, WarmUp& warm_up,
                     WarmUp& warm_up_steps, Fp8RankTimings& timings, LayerRunResult& result) {
  const int64_t tokens = spec.tokens_per_rank, hidden = spec.shape.hidden;
  cudaEvent_t marks[2];
  for (cudaEvent_t& mark : marks) MOK_CUDA_CHECK(cudaEventCreate(&mark));
  MOK_CUDA_CHECK(cudaEventRecord(marks[0], stream));
  layer.quantize_weights(weights, stream);
  MOK_CUDA_CHECK(cudaEventRecord(marks[1], stream));
  MOK_CUDA_CHECK(cudaEventSynchronize(marks[1]));
  float quantize_ms = 0;
  MOK_CUDA_CHECK(cudaEventElapsedTime(&quantize_ms, marks[0], marks[1]));
  for (cudaEvent_t mark : marks) cudaEventDestroy(mark);
  timings.quantize_ms = quantize_ms;
  timings.buffer_bytes = layer.buffer_bytes();
  timings.weight_bytes = layer.weight_bytes();
  warm_up.run(spec, rank, stream, [&] { layer.forward(x, topk_idx, topk_w, y, tokens, stream); });
  layer.check(stream);
  const std::string loop = std::string(precision_name(spec.fp8_precision)) + "-fwd";
  timings.forward = time_forwards(spec, rank, loop, stream, [&](const cudaEvent_t* phase_marks) {
    layer.forward(x, topk_idx, topk_w, y, tokens, stream, phase_marks);
  });
  layer.check(stream);
  if (spec.keep_y) {
    MOK_CUDA_CHECK(cudaMemcpy(result.fp8_y.data() + rank * tokens * hidden, y,
                              static_cast<size_t>(tokens * hidden) * sizeof(bf16),
                              cudaMemcpyDeviceToHost));
  }
  if (spec.backward) {
    run_fp8_backward<Backward>(spec, rank, comm, layer, weights, x, topk_idx, topk_w, y, stream,
                               warm_up_steps, timings, result);
  }
}

// Save mode again with the low-memory backward (spec.chunked_backward, EP 1): timed as
// run_backward's pairs without phases, its buffers, and its outputs against save mode's, which
// `io` holds, bitwise (result.chunked_same_bits).
template <class Forward>
void time_chunked_backward(const LayerRunSpec& spec, int rank, const Communicator& comm,
                           LayerBackwardOptions options, const DeviceLayerWeights& weights,
                           const bf16* x, const int32_t* topk_idx, const float* topk_w,
                           cudaStream_t stream, const Forward& forward, WarmUp& warm_up,
                           BackwardBuffers& io, const SavedContext& context,
                           LayerRunResult& result) {
  const int64_t tokens = spec.tokens_per_rank;
  options.chunk_rows = low_memory_chunk_rows(tokens);
  LayerBackward layer(comm, spec.shape, tokens, options);
  result.backward_chunked_buffer_bytes_per_rank = layer.buffer_bytes();
  // Fingerprints of every output (device_fingerprint: no copy to the host, whose memory the
  // weight gradients of a large layer would fill twice over).
  const auto outputs = [&] {
    std::vector<uint64_t> prints;
    const auto add = [&](const auto& buffer) {
      prints.push_back(
          device_fingerprint(buffer.get(), static_cast<int64_t>(buffer.bytes()), stream));
    };
    add(io.dx);
    add(io.d_topk_w);
    add(io.grad_gate_up);
    add(io.grad_down);
    if (spec.shape.has_shared()) {
      add(io.grad_shared_gate_up);
      add(io.grad_shared_down);
    }
    return prints;
  };
  const std::vector<uint64_t> saved_outputs = outputs();
  constexpr int kLastMark = kNumBackwardPhases + 1;
  const BackwardTiming timing = time_pairs(
      spec, rank, "fwdbwd-chunked", stream, warm_up, layer.phase_order(),
      [&](const cudaEvent_t* marks) {
        if (marks != nullptr) MOK_CUDA_CHECK(cudaEventRecord(marks[0], stream));
        forward(&context);
        if (marks != nullptr) MOK_CUDA_CHECK(cudaEventRecord(marks[1], stream));
        layer.backward(weights, x, topk_idx, topk_w, io.dy.get(), io.dx.get(), io.d_topk_w.get(),
                       io.grads, tokens, stream, nullptr, &context);
        if (marks != nullptr) MOK_CUDA_CHECK(cudaEventRecord(marks[kLastMark], stream));
      },
      [&] { layer.check(stream); }, /*phases=*/false);
  result.backward_chunked_ms = timing.backward_ms;
  result.forward_backward_chunked_ms = timing.pair_ms;
  result.chunked_same_bits = outputs() == saved_outputs;
}

// The backward part of run_layer_forward for one rank: LayerBackward on the forward's inputs and
// a dy, warmed up and timed in forward + backward pairs, in recompute mode and (spec.save_context)
// save mode, whose forwards keep the context; the last mode's outputs into `result` (keep_y).
// forward(save): one forward, keeping its context in `save` unless null.
template <class Forward>
void run_backward(const LayerRunSpec& spec, int rank, const Communicator& comm,
                  const DeviceLayerWeights& weights, const bf16* x, const int32_t* topk_idx,
                  const float* topk_w, cudaStream_t stream, const Forward& forward, WarmUp& warm_up,
                  LayerRunResult& result, BackwardTiming& recompute, BackwardTiming& save,
                  int64_t& buffer_bytes, int64_t& context_bytes) {
  const LayerShape& shape = spec.shape;
  const int64_t tokens = spec.tokens_per_rank, hidden = shape.hidden, top_k = shape.top_k;
  LayerBackwardOptions options;
  options.gemm.engine = static_cast<gemm::GemmEngine>(spec.backward_engine);
  options.gemm.wgrad_cluster = spec.wgrad_cluster;
  LayerBackward layer(comm, shape, tokens, options);
  buffer_bytes = layer.buffer_bytes();
  BackwardBuffers io(spec, rank, weights,
                     spec.bf16_gradients ? gemm::WgradOutput::kBf16 : gemm::WgradOutput::kFp32);
  const int64_t context_tokens = spec.save_context ? tokens : 0;
  DeviceBuffer<bf16> saved_gate_up(saved_context_rows(spec.ep, tokens, top_k, context_tokens) * 2 *
                                   shape.intermediate);
  DeviceBuffer<bf16> saved_shared_gate_up(context_tokens * 2 * shape.shared_intermediate);
  context_bytes = static_cast<int64_t>(saved_gate_up.bytes() + saved_shared_gate_up.bytes());
  const SavedContext context{saved_gate_up.get(),
                             shape.has_shared() ? saved_shared_gate_up.get() : nullptr};
  // Timed pairs of one mode (saved: its context, or null for recompute mode).
  const auto time_mode = [&](const SavedContext* saved, BackwardTiming& timing) {
    timing = time_pairs(
        spec, rank, saved != nullptr ? "fwdbwd" : "fwdbwd-recompute", stream, warm_up,
        layer.phase_order(),
        [&](const cudaEvent_t* marks) {
          if (marks != nullptr) MOK_CUDA_CHECK(cudaEventRecord(marks[0], stream));
          forward(saved);
          layer.backward(weights, x, topk_idx, topk_w, io.dy.get(), io.dx.get(), io.d_topk_w.get(),
                         io.grads, tokens, stream, marks != nullptr ? marks + 1 : nullptr, saved);
        },
        [&] { layer.check(stream); });
  };
  time_mode(nullptr, recompute);
  if (spec.save_context) time_mode(&context, save);
  if (rank == 0) result.backward_schedule_pass_us = layer.workspace().schedule_pass_us();
  if (spec.chunked_backward && spec.save_context && spec.ep == 1) {
    time_chunked_backward(spec, rank, comm, options, weights, x, topk_idx, topk_w, stream, forward,
                          warm_up, io, context, result);
  }
  if (!spec.keep_y) return;
  const int64_t experts_local = shape.num_experts / spec.ep;
  io.dx.download(result.dx.data() + rank * tokens * hidden);
  io.d_topk_w.download(result.d_topk_w.data() + rank * tokens * top_k);
  io.grad_gate_up.download(result.grad_gate_up.data() +
                           rank * experts_local * 2 * shape.intermediate * hidden);
  io.grad_down.download(result.grad_down.data() +
                        rank * experts_local * hidden * shape.intermediate);
  if (shape.has_shared()) {
    io.grad_shared_gate_up.download(result.grad_shared_gate_up.data() +
                                    rank * io.grad_shared_gate_up.size());
    io.grad_shared_down.download(result.grad_shared_down.data() +
                                 rank * io.grad_shared_down.size());
  }
}

}  // namespace mok::runtime
