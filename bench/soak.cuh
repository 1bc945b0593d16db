// The soak itself (bench_soak.cu): the GPU layer stepped with a new routing and dy every step,
// the probe before and after, memory and device faults checked, the time per step recorded.
#pragma once

#include <chrono>
#include <memory>

#include "soak_inputs.cuh"

namespace mok::soak {

// What the command line sets (bench_soak --help).
struct Args {
  int64_t steps = 10000;
  std::optional<std::string> preset;
  std::optional<int64_t> hidden, intermediate, shared_intermediate, experts, top_k;
  int64_t tokens = 2048;
  int64_t seed = 1;
  int64_t check_every = 500, progress_every = 1000, window = 500;
  int64_t drift_limit_percent = 10, memory_tolerance_mib = 1, warmup_ms = 1000;
  std::string out = "soak.json";
};

// ---- the soak -------------------------------------------------------------------------------

struct Report {
  int64_t steps_done = 0;
  std::string error;             // a device fault or CUDA error, with the steps it hit
  std::string probe_difference;  // empty: bitwise equal
  std::string probe_non_finite;  // empty: every element finite
  bool probe_compared = false;
  int64_t memory_start = 0, memory_end = -1;
  std::vector<float> step_ms;
  int64_t window = 0;
  double first_ms = 0, last_ms = 0, drift_percent = 0, median_ms = 0;
  double seconds = 0;
};

class Soak {
 public:
  Soak(const Args& args, const mok::LayerShape& shape, std::FILE* progress)
      : args_(args),
        shape_(shape),
        progress_(progress),
        layer_(/*device=*/0, shape, args.tokens),
        x_(args.tokens * shape.hidden),
        dy_(args.tokens * shape.hidden),
        probe_dy_(args.tokens * shape.hidden),
        y_(args.tokens * shape.hidden),
        dx_(args.tokens * shape.hidden),
        topk_idx_(args.tokens * shape.top_k),
        probe_topk_idx_(args.tokens * shape.top_k),
        topk_w_(args.tokens * shape.top_k),
        probe_topk_w_(args.tokens * shape.top_k),
        d_topk_w_(args.tokens * shape.top_k),
        grad_gate_up_(layer_.weights().gate_up_elements),
        grad_down_(layer_.weights().down_elements),
        grad_shared_gate_up_(layer_.weights().shared_gate_up_elements),
        grad_shared_down_(layer_.weights().shared_down_elements) {
    MOK_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    const mok::GpuLayerWeights& weights = layer_.weights();
    const uint64_t seed = static_cast<uint64_t>(args.seed);
    // Scales as Problem::generate: every intermediate near unit size.
    const double in_scale = 1.0 / std::sqrt(static_cast<double>(shape.hidden));
    fill_random(weights.gate_up, weights.gate_up_elements, in_scale, seed, 10, stream_);
    fill_random(weights.down, weights.down_elements,
                1.0 / std::sqrt(static_cast<double>(shape.intermediate)), seed, 11, stream_);
    fill_random(weights.shared_gate_up, weights.shared_gate_up_elements, in_scale, seed, 12,
                stream_);
    fill_random(
        weights.shared_down, weights.shared_down_elements,
        1.0 / std::sqrt(static_cast<double>(std::max<int64_t>(shape.shared_intermediate, 1))), seed,
        13, stream_);
    fill_random(x_.get(), x_.size(), 1.0, seed, 14, stream_);
    // The probe: unused slots and signed weights, most experts with rows; its own dy.
    fill_random(probe_dy_.get(), probe_dy_.size(), 1.0, seed, 15, stream_);
    make_routing(probe_topk_idx_.get(), probe_topk_w_.get(), shape, args.tokens,
                 Routing::kUnusedSlots, seed, kProbeStep, stream_);
    MOK_CUDA_CHECK(cudaStreamSynchronize(stream_));
    const bool shared = shape.has_shared();
    grads_ = {grad_gate_up_.get(), grad_down_.get(), shared ? grad_shared_gate_up_.get() : nullptr,
              shared ? grad_shared_down_.get() : nullptr, mok::gemm::WgradOutput::kFp32};
    const int64_t chunk = std::min(args.check_every, args.progress_every);
    events_.resize(static_cast<size_t>(2 * chunk));
    for (cudaEvent_t& event : events_) MOK_CUDA_CHECK(cudaEventCreate(&event));
  }

  ~Soak() {
    for (cudaEvent_t event : events_) cudaEventDestroy(event);
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }
  Soak(const Soak&) = delete;
  Soak& operator=(const Soak&) = delete;

  Report run() {
    Report report;
    const auto start = std::chrono::steady_clock::now();
    const std::vector<ProbeTensor> before = probe();
    report.probe_non_finite = non_finite(before);
    warm_up();
    report.memory_start = device_bytes_in_use();
    say("device memory in use before the soak: %.1f MiB (the layer's buffers: forward %.1f MiB, "
        "backward %.1f MiB)\n",
        mib(static_cast<double>(report.memory_start)),
        mib(static_cast<double>(layer_.forward_buffer_bytes())),
        mib(static_cast<double>(layer_.backward_buffer_bytes())));
    soak(report);
    if (report.error.empty()) {
      try {
        const std::vector<ProbeTensor> after = probe();
        report.probe_compared = true;
        report.probe_difference = first_difference(before, after);
        if (report.probe_non_finite.empty()) report.probe_non_finite = non_finite(after);
        report.memory_end = device_bytes_in_use();
      } catch (const std::exception& error) {
        report.error = concat("in the probe after the soak: ", error.what());
      }
    }
    report.seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    summarize(report);
    return report;
  }

 private:
  static constexpr uint64_t kProbeStep = ~uint64_t{0};
  static constexpr uint64_t kWarmUpStep = uint64_t{1} << 40;  // warm-up routings: another range

  template <class... Parts>
  void say(const char* format, Parts... parts) {
    std::fprintf(progress_, format, parts...);
    std::fflush(progress_);
  }

  // Enqueues one training step on its own inputs: routing and dy of step `step`, then forward
  // and backward (between events `start` and `stop` when given).
  void enqueue_step(uint64_t step, cudaEvent_t start = nullptr, cudaEvent_t stop = nullptr) {
    const uint64_t seed = static_cast<uint64_t>(args_.seed);
    make_routing(topk_idx_.get(), topk_w_.get(), shape_, args_.tokens,
                 static_cast<Routing>(step % kNumRoutings), seed, step, stream_);
    fill_random(dy_.get(), dy_.size(), 1.0, seed, 1000 + step, stream_);
    if (start != nullptr) MOK_CUDA_CHECK(cudaEventRecord(start, stream_));
    layer_.forward(x_.get(), topk_idx_.get(), topk_w_.get(), y_.get(), args_.tokens, stream_);
    layer_.backward(x_.get(), topk_idx_.get(), topk_w_.get(), dy_.get(), dx_.get(), d_topk_w_.get(),
                    grads_, args_.tokens, stream_);
    if (stop != nullptr) MOK_CUDA_CHECK(cudaEventRecord(stop, stream_));
  }

  void check() { layer_.check(stream_); }

  // The probe's outputs, every one poisoned (0xff: NaN) first so that an unwritten element shows.
  std::vector<ProbeTensor> probe() {
    std::vector<ProbeTensor> tensors = {
        {"y", y_.get(), y_.bytes(), 2, {}},
        {"dx", dx_.get(), dx_.bytes(), 2, {}},
        {"d_topk_w", d_topk_w_.get(), d_topk_w_.bytes(), 4, {}},
        {"grad_gate_up", grad_gate_up_.get(), grad_gate_up_.bytes(), 4, {}},
        {"grad_down", grad_down_.get(), grad_down_.bytes(), 4, {}}};
    if (shape_.has_shared()) {
      tensors.push_back(
          {"grad_shared_gate_up", grad_shared_gate_up_.get(), grad_shared_gate_up_.bytes(), 4, {}});
      tensors.push_back(
          {"grad_shared_down", grad_shared_down_.get(), grad_shared_down_.bytes(), 4, {}});
    }
    for (const ProbeTensor& tensor : tensors) {
      MOK_CUDA_CHECK(
          cudaMemsetAsync(const_cast<void*>(tensor.device), 0xff, tensor.bytes, stream_));
    }
    layer_.forward(x_.get(), probe_topk_idx_.get(), probe_topk_w_.get(), y_.get(), args_.tokens,
                   stream_);
    layer_.backward(x_.get(), probe_topk_idx_.get(), probe_topk_w_.get(), probe_dy_.get(),
                    dx_.get(), d_topk_w_.get(), grads_, args_.tokens, stream_);
    check();
    for (ProbeTensor& tensor : tensors) {
      tensor.host.resize(tensor.bytes);
      MOK_CUDA_CHECK(
          cudaMemcpy(tensor.host.data(), tensor.device, tensor.bytes, cudaMemcpyDeviceToHost));
    }
    return tensors;
  }

  // Every routing at least once, then more steps until args.warmup_ms have passed.
  void warm_up() {
    const auto start = std::chrono::steady_clock::now();
    uint64_t step = kWarmUpStep;
    for (;;) {
      for (int routing = 0; routing < kNumRoutings; ++routing) enqueue_step(step++);
      check();
      const std::chrono::duration<double, std::milli> spent =
          std::chrono::steady_clock::now() - start;
      if (spent.count() >= static_cast<double>(args_.warmup_ms)) break;
    }
    say("warm-up: %llu steps in %.0f ms\n", static_cast<unsigned long long>(step - kWarmUpStep),
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
            .count());
  }

  // The soak's steps in chunks that end at a check or a progress line; stops at the first error.
  void soak(Report& report) {
    const int64_t steps = args_.steps;
    const auto start = std::chrono::steady_clock::now();
    auto next = [](int64_t done, int64_t every) { return (done / every + 1) * every; };
    int64_t done = 0;
    while (done < steps) {
      const int64_t end =
          std::min({steps, next(done, args_.check_every), next(done, args_.progress_every)});
      try {
        for (int64_t step = done; step < end; ++step) {
          const size_t event = static_cast<size_t>(2 * (step - done));
          enqueue_step(static_cast<uint64_t>(step), events_[event], events_[event + 1]);
        }
        check();
        for (int64_t step = done; step < end; ++step) {
          const size_t event = static_cast<size_t>(2 * (step - done));
          float ms = 0;
          MOK_CUDA_CHECK(cudaEventElapsedTime(&ms, events_[event], events_[event + 1]));
          report.step_ms.push_back(ms);
        }
      } catch (const std::exception& error) {
        report.error =
            concat("in steps ", done, " to ", end - 1, " (routings rotate ", kRoutingNames[0], ", ",
                   kRoutingNames[1], ", ", kRoutingNames[2], ", ", kRoutingNames[3], ", ",
                   kRoutingNames[4], " by step % ", kNumRoutings, "): ", error.what());
        say("%s\n", report.error.c_str());
        return;
      }
      done = end;
      report.steps_done = done;
      if (done % args_.progress_every == 0 || done == steps) {
        const int64_t last = std::min(done, args_.progress_every);
        const std::vector<float> recent(report.step_ms.end() - last, report.step_ms.end());
        say("step %7lld/%lld  forward + backward %.3f ms/step (median of the last %lld)  device "
            "memory in use %.1f MiB  %.1f s\n",
            static_cast<long long>(done), static_cast<long long>(steps), median(recent),
            static_cast<long long>(last), mib(static_cast<double>(device_bytes_in_use())),
            std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
      }
    }
  }

  void summarize(Report& report) const {
    const int64_t measured = static_cast<int64_t>(report.step_ms.size());
    report.window = std::min(args_.window, measured / 2);
    if (report.window > 0) {
      const auto& ms = report.step_ms;
      report.first_ms = median(std::vector<float>(ms.begin(), ms.begin() + report.window));
      report.last_ms = median(std::vector<float>(ms.end() - report.window, ms.end()));
      report.drift_percent = 100.0 * (report.last_ms - report.first_ms) / report.first_ms;
      report.median_ms = median(ms);
    }
  }

  const Args& args_;
  mok::LayerShape shape_;
  std::FILE* progress_;
  mok::GpuLayer layer_;
  mok::DeviceBuffer<mok::bf16> x_, dy_, probe_dy_, y_, dx_;    // (T, H)
  mok::DeviceBuffer<int32_t> topk_idx_, probe_topk_idx_;       // (T, k)
  mok::DeviceBuffer<float> topk_w_, probe_topk_w_, d_topk_w_;  // (T, k)
  mok::DeviceBuffer<float> grad_gate_up_, grad_down_, grad_shared_gate_up_, grad_shared_down_;
  mok::GpuLayerGradients grads_;
  cudaStream_t stream_ = nullptr;
  std::vector<cudaEvent_t> events_;  // (chunk, 2): start and stop of each step
};

}  // namespace mok::soak
