// Soak: many training steps of the GPU layer (mok::GpuLayer) on one GPU at EP 1 — the fused forward
// and the backward — with a new routing every step, made on the
// device from the step number: uniform, skewed, every token to one expert, a few hot experts, and
// unused (-1) slots, in rotation; router weights of either sign; a new dy every step. It checks
// what a long training run relies on:
//   - a fixed probe (routing, x, dy) gives the same bits for every output (y, dx, d_topk_w, the
//     four weight gradients) after the soak as before it, and writes every element;
//   - device memory in use after the soak equals the use before it (cudaMemGetInfo);
//   - no device-side fault is recorded (both layers' check, every --check-every steps);
//   - the time per step does not drift: median of the first --window steps against the last.
// Exit status 0 when the first three hold (a drift is reported, not failed), 1 otherwise or on
// any error, 2 for a wrong command line.
//
//   bench_soak [options]    (bench_soak --help lists them)
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "bench_options.hpp"
#include "mok/cuda_check.hpp"
#include "mok/device_buffer.hpp"
#include "mok/error.hpp"
#include "mok/gpu.hpp"
#include "mok/gpu_layer.hpp"
#include "mok/layer_runner.hpp"
#include "mok/shape.hpp"

namespace {

using mok::bench::UsageError;
using mok::detail::concat;

// ---- device-side inputs ---------------------------------------------------------------------

// SplitMix64's finaliser: a counter-based hash, the same on every GPU and in every run.
__host__ __device__ inline uint64_t mix(uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

__device__ inline float unit_interval(uint64_t bits) {  // [0, 1)
  return static_cast<float>(bits >> 40) * (1.0f / 16777216.0f);
}

// Uniform values with standard deviation `scale` from (seed, stream, index).
__global__ void fill_random_kernel(__nv_bfloat16* out, int64_t count, float scale, uint64_t seed,
                                   uint64_t stream) {
  const float half_width = scale * 1.7320508f;
  const uint64_t base = mix(seed ^ mix(stream));
  for (int64_t index = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; index < count;
       index += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float unit = unit_interval(mix(base + static_cast<uint64_t>(index)));
    out[index] = __float2bfloat16_rn(half_width * (2.0f * unit - 1.0f));
  }
}

void fill_random(mok::bf16* out, int64_t count, double scale, uint64_t seed, uint64_t stream,
                 cudaStream_t cuda_stream) {
  if (count == 0) return;
  const int blocks = static_cast<int>(std::min<int64_t>((count + 255) / 256, 2048));
  fill_random_kernel<<<blocks, 256, 0, cuda_stream>>>(reinterpret_cast<__nv_bfloat16*>(out), count,
                                                      static_cast<float>(scale), seed, stream);
  MOK_CUDA_CHECK_LAUNCH();
}

// The routings of the rotation; step s uses routing s % kNumRoutings, so that every window of a
// multiple of kNumRoutings steps holds the same mix (500 and 1000 are).
enum class Routing : int {
  kUniform = 0,      // k distinct experts, uniformly
  kSkewed = 1,       // expert ~ E·u⁴: a few experts take most rows, many none
  kOneExpert = 2,    // every token to one expert (slot 0), the other slots -1
  kHotExperts = 3,   // k distinct experts out of k + 2 neighbours: the rest of the experts empty
  kUnusedSlots = 4,  // uniform, each slot -1 with probability 0.3 (some rows all -1)
};
constexpr int kNumRoutings = 5;
const char* const kRoutingNames[kNumRoutings] = {"uniform", "skewed", "one-expert", "hot-experts",
                                                 "unused-slots"};

// One token per thread: its k ids (distinct but for -1, as the contract asks) and weights of
// either sign (unused slots too: their weight must be ignored). `hot`: the step's hot expert.
__global__ void make_routing_kernel(int32_t* topk_idx, float* topk_w, int num_tokens, int top_k,
                                    int num_experts, Routing routing, uint64_t seed,
                                    uint64_t step) {
  const int token = blockIdx.x * blockDim.x + threadIdx.x;
  if (token >= num_tokens) return;
  const uint64_t step_key = mix(seed ^ mix(step));
  const int hot = static_cast<int>(step_key % static_cast<uint64_t>(num_experts));
  const int window = min(num_experts, top_k + 2);  // kHotExperts; >= k, so a free id exists
  int32_t* row = topk_idx + static_cast<int64_t>(token) * top_k;
  float* weights = topk_w + static_cast<int64_t>(token) * top_k;
  const uint64_t token_key = mix(step_key + static_cast<uint64_t>(token));
  for (int slot = 0; slot < top_k; ++slot) {
    const uint64_t draw = mix(token_key + 3u * slot);
    const uint64_t extra = mix(token_key + 3u * slot + 1u);
    int expert = static_cast<int>(draw % static_cast<uint64_t>(num_experts));
    switch (routing) {
      case Routing::kUniform:
      case Routing::kUnusedSlots:
        break;
      case Routing::kSkewed: {
        const float u = unit_interval(draw);
        expert = min(num_experts - 1, static_cast<int>(num_experts * (u * u) * (u * u)));
        break;
      }
      case Routing::kOneExpert:
        expert = slot == 0 ? hot : -1;
        break;
      case Routing::kHotExperts:
        expert = (hot + static_cast<int>(draw % static_cast<uint64_t>(window))) % num_experts;
        break;
    }
    if (routing == Routing::kUnusedSlots && unit_interval(extra) < 0.3f) expert = -1;
    if (expert >= 0) {
      // Taken by an earlier slot: the next id (within the window for kHotExperts).
      auto taken = [&](int id) {
        for (int earlier = 0; earlier < slot; ++earlier) {
          if (row[earlier] == id) return true;
        }
        return false;
      };
      while (taken(expert)) {
        expert =
            routing == Routing::kHotExperts
                ? (hot + ((expert - hot + num_experts) % num_experts + 1) % window) % num_experts
                : (expert + 1) % num_experts;
      }
    }
    row[slot] = expert;
    weights[slot] = 2.0f * unit_interval(mix(token_key + 3u * slot + 2u)) - 1.0f;
  }
}

void make_routing(int32_t* topk_idx, float* topk_w, const mok::LayerShape& shape,
                  int64_t num_tokens, Routing routing, uint64_t seed, uint64_t step,
                  cudaStream_t stream) {
  const int blocks = static_cast<int>((num_tokens + 255) / 256);
  make_routing_kernel<<<blocks, 256, 0, stream>>>(
      topk_idx, topk_w, static_cast<int>(num_tokens), static_cast<int>(shape.top_k),
      static_cast<int>(shape.num_experts), routing, seed, step);
  MOK_CUDA_CHECK_LAUNCH();
}

// ---- host helpers ---------------------------------------------------------------------------

double median(std::vector<float> values) {
  if (values.empty()) return 0.0;
  std::sort(values.begin(), values.end());
  return values[values.size() / 2];
}

double mib(double bytes) { return bytes / (1024.0 * 1024.0); }

int64_t device_bytes_in_use() {
  size_t free_bytes = 0, total_bytes = 0;
  MOK_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
  return static_cast<int64_t>(total_bytes - free_bytes);
}

// ---- command line ---------------------------------------------------------------------------

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

// H 1024, I 512, I_s 512, E 32, top-4: small, but every path of the layer is real (several K
// blocks and N tiles, a shared expert, experts of many and of no rows).
constexpr mok::LayerShape kDefaultShape{1024, 512, 512, 32, 4};

constexpr char kUsage[] =
    R"(bench_soak: many forward + backward training steps of the GPU layer (one Hopper GPU, EP 1) with
a new routing every step, made on the device (uniform, skewed, every token to one expert, a few hot
experts, unused -1 slots, in rotation; router weights of either sign; a new dy every step).
Before and after the soak a fixed probe runs; the soak passes when the probe's every output is
bitwise the same, device memory in use is flat and no device-side fault was recorded. The time per
step (forward + backward) of the first and the last steps is reported; a drift beyond the limit
is flagged, not failed. Exit status: 0 passed, 1 failed or an error, 2 a wrong command line.

usage: bench_soak [options]

  --steps N                 training steps (default 10000, at least 2)
  --preset NAME             the shape of a preset (tiny, deepseek-v3, qwen3-30b-a3b,
                            qwen3-235b-a22b, mixtral-8x7b) instead of the default
                            H 1024, I 512, I_s 512, E 32, top-4
  --hidden H, --intermediate I, --shared-intermediate I_S, --experts E, --top-k K
                            one dimension of the shape (over the preset's or the default's)
  --tokens T                tokens per step (default 2048)
  --seed S                  seed of the weights, x, the routings and dy (default 1)
  --check-every K           steps between the layers' device-fault checks (default 500)
  --progress-every N        steps between progress lines (default 1000)
  --window N                steps in the first and last windows whose medians are compared
                            (default 500; at most half the steps)
  --drift-limit PERCENT     a change of the median time per step beyond this is flagged
                            (default 10)
  --memory-tolerance-mib M  device memory may differ by this much at the end (default 1)
  --warmup-ms MS            untimed steps (every routing at least once) for MS ms before the
                            soak, so that it runs at the clock its own power draw sets under the
                            power cap, and every kernel is loaded before memory is read
                            (default 1000)
  --out FILE                results JSON, schema mok-soak/1 (default soak.json; - = standard
                            output, the progress lines then go to standard error); the commit
                            in it is $MOK_COMMIT's, when set
)";

// The whole of `value` as a number in [low, high]: digits only (no sign, no leading zero, no
// base prefix), or a UsageError naming the option.
int64_t number(const std::string& name, const std::string& value, int64_t low, int64_t high) {
  const bool digits =
      !value.empty() && value.size() <= 18 &&
      std::all_of(value.begin(), value.end(), [](char c) { return c >= '0' && c <= '9'; }) &&
      (value.size() == 1 || value[0] != '0');
  if (!digits) throw UsageError(name, concat("expected an integer, got '", value, "'"));
  const int64_t result = std::stoll(value);
  if (result < low || result > high) {
    throw UsageError(name, concat("must be in [", low, ", ", high, "], got ", result));
  }
  return result;
}

// An error's message without its "argument: " prefix.
std::string message_of(const mok::Error& error) {
  const std::string text = error.what(), prefix = error.argument() + ": ";
  return text.rfind(prefix, 0) == 0 ? text.substr(prefix.size()) : text;
}

// Returns false when --help was asked for.
bool parse(int argc, char** argv, Args& args) {
  std::set<std::string> seen;
  constexpr int64_t kMax = int64_t{1} << 40;
  return mok::bench::parse_options(argc, argv, kUsage,
                                   [&](const std::string& key, const std::string& value) {
                                     if (!seen.insert(key).second)
                                       throw UsageError(key, "given twice");
                                     if (key == "--steps")
                                       args.steps = number(key, value, 2, kMax);
                                     else if (key == "--preset") {
                                       try {
                                         mok::find_preset(value);
                                       } catch (const mok::Error& error) {
                                         throw UsageError(key, message_of(error));
                                       }
                                       args.preset = value;
                                     } else if (key == "--hidden")
                                       args.hidden = number(key, value, 1, kMax);
                                     else if (key == "--intermediate")
                                       args.intermediate = number(key, value, 1, kMax);
                                     else if (key == "--shared-intermediate")
                                       args.shared_intermediate = number(key, value, 0, kMax);
                                     else if (key == "--experts")
                                       args.experts = number(key, value, 1, kMax);
                                     else if (key == "--top-k")
                                       args.top_k = number(key, value, 1, kMax);
                                     else if (key == "--tokens")
                                       args.tokens = number(key, value, 1, int64_t{1} << 30);
                                     else if (key == "--seed")
                                       args.seed = number(key, value, 0, kMax);
                                     else if (key == "--check-every")
                                       args.check_every = number(key, value, 1, kMax);
                                     else if (key == "--progress-every")
                                       args.progress_every = number(key, value, 1, kMax);
                                     else if (key == "--window")
                                       args.window = number(key, value, 1, kMax);
                                     else if (key == "--drift-limit")
                                       args.drift_limit_percent = number(key, value, 0, 1000);
                                     else if (key == "--memory-tolerance-mib")
                                       args.memory_tolerance_mib = number(key, value, 0, kMax);
                                     else if (key == "--warmup-ms")
                                       args.warmup_ms = number(key, value, 0, 3600 * 1000);
                                     else if (key == "--out") {
                                       if (value.empty())
                                         throw UsageError(key, "expected a file name or -, got ''");
                                       args.out = value;
                                     } else
                                       return false;
                                     return true;
                                   });
}

mok::LayerShape shape_of(const Args& args) {
  mok::LayerShape shape = args.preset ? mok::find_preset(*args.preset).shape : kDefaultShape;
  if (args.hidden) shape.hidden = *args.hidden;
  if (args.intermediate) shape.intermediate = *args.intermediate;
  if (args.shared_intermediate) shape.shared_intermediate = *args.shared_intermediate;
  if (args.experts) shape.num_experts = *args.experts;
  if (args.top_k) shape.top_k = *args.top_k;
  try {
    shape.validate(1);
  } catch (const mok::Error& error) {
    // Named by the option that sets the field ("top_k" -> --top-k).
    std::string option = error.argument();
    std::replace(option.begin(), option.end(), '_', '-');
    if (option == "num-experts") option = "experts";
    const bool known = option == "hidden" || option == "intermediate" ||
                       option == "shared-intermediate" || option == "experts" || option == "top-k";
    throw UsageError(known ? "--" + option : "shape", known ? message_of(error) : error.what());
  }
  return shape;
}

// ---- the probe ------------------------------------------------------------------------------

// One output of the probe, downloaded.
struct ProbeTensor {
  const char* name;
  const void* device;
  size_t bytes;
  int element_bytes;  // 2: bf16, 4: fp32
  std::vector<uint8_t> host;
};

bool finite_element(const uint8_t* element, int element_bytes) {
  if (element_bytes == 2) {
    uint16_t bits;
    std::memcpy(&bits, element, 2);
    return (bits & 0x7f80u) != 0x7f80u;
  }
  uint32_t bits;
  std::memcpy(&bits, element, 4);
  return (bits & 0x7f800000u) != 0x7f800000u;
}

// "grad_down element 17 (start 0x3f800000, end 0x3f800001)", or empty when every bit is equal.
std::string first_difference(const std::vector<ProbeTensor>& start,
                             const std::vector<ProbeTensor>& end) {
  for (size_t which = 0; which < start.size(); ++which) {
    const ProbeTensor& a = start[which];
    const ProbeTensor& b = end[which];
    if (std::memcmp(a.host.data(), b.host.data(), a.host.size()) == 0) continue;
    for (size_t offset = 0; offset < a.host.size(); offset += a.element_bytes) {
      if (std::memcmp(&a.host[offset], &b.host[offset], a.element_bytes) == 0) continue;
      uint32_t bits_a = 0, bits_b = 0;
      std::memcpy(&bits_a, &a.host[offset], a.element_bytes);
      std::memcpy(&bits_b, &b.host[offset], a.element_bytes);
      char text[160];
      std::snprintf(text, sizeof(text), "%s element %zu (start 0x%0*x, end 0x%0*x)", a.name,
                    offset / a.element_bytes, 2 * a.element_bytes, bits_a, 2 * a.element_bytes,
                    bits_b);
      return text;
    }
  }
  return "";
}

// "dx: 12 elements not finite", or empty.
std::string non_finite(const std::vector<ProbeTensor>& tensors) {
  for (const ProbeTensor& tensor : tensors) {
    int64_t count = 0;
    for (size_t offset = 0; offset < tensor.host.size(); offset += tensor.element_bytes) {
      count += finite_element(&tensor.host[offset], tensor.element_bytes) ? 0 : 1;
    }
    if (count > 0) return concat(tensor.name, ": ", count, " elements not finite (unwritten?)");
  }
  return "";
}

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

std::string json_string(const std::string& text) {
  std::string out = "\"";
  for (char c : text) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      char escaped[8];
      std::snprintf(escaped, sizeof(escaped), "\\u%04x", c);
      out += escaped;
    } else {
      out += c;
    }
  }
  return out + "\"";
}

int run(int argc, char** argv) {
  Args args;
  if (!parse(argc, argv, args)) return 0;
  const mok::LayerShape shape = shape_of(args);
  const mok::GpuSummary gpus = mok::query_gpus();
  MOK_CHECK_ARG(gpus.num_hopper_gpus >= 1, "GPU",
                "the soak needs a Hopper GPU; found: ", gpus.description);
  const std::string unfit = mok::gpu_layer_unfit_reason(shape, 1, args.tokens, true);
  MOK_CHECK_ARG(unfit.empty(), "shape", unfit);
  MOK_CUDA_CHECK(cudaSetDevice(0));
  cudaDeviceProp properties{};
  MOK_CUDA_CHECK(cudaGetDeviceProperties(&properties, 0));
  // The JSON's path is checked before any work; write errors are reported at the end.
  const bool to_stdout = args.out == "-";
  std::unique_ptr<std::FILE, int (*)(std::FILE*)> out(
      to_stdout ? stdout : std::fopen(args.out.c_str(), "w"),
      to_stdout ? +[](std::FILE*) { return 0; }
                : +[](std::FILE* file) { return std::fclose(file); });
  if (out == nullptr) {
    throw mok::Error("--out", concat("cannot write '", args.out, "': ", std::strerror(errno)));
  }
  std::FILE* progress = to_stdout ? stderr : stdout;
  std::fprintf(progress, "soak: %lld steps of forward + backward, %s, %lld tokens, on %s\n",
               static_cast<long long>(args.steps), shape.describe().c_str(),
               static_cast<long long>(args.tokens), properties.name);
  std::fflush(progress);

  Report report;
  try {
    Soak soak(args, shape, progress);
    report = soak.run();
  } catch (const std::exception& error) {  // setting up, or the probe before the soak
    report.error = error.what();
    std::fprintf(progress, "%s\n", report.error.c_str());
  }

  const int64_t tolerance = args.memory_tolerance_mib << 20;
  const int64_t growth = report.memory_end >= 0 ? report.memory_end - report.memory_start : 0;
  const bool memory_flat = report.memory_end >= 0 && std::llabs(growth) <= tolerance;
  const bool probe_equal = report.probe_compared && report.probe_difference.empty();
  const bool drift_flagged = report.window > 0 && std::fabs(report.drift_percent) >
                                                      static_cast<double>(args.drift_limit_percent);
  const bool passed = report.error.empty() && probe_equal && report.probe_non_finite.empty() &&
                      memory_flat && report.steps_done == args.steps;

  std::fprintf(progress, "probe (y, dx, d_topk_w, weight gradients): %s\n",
               !report.probe_compared ? "not compared (the soak stopped)"
               : probe_equal          ? "bitwise equal before and after the soak"
                             : ("DIFFERS after the soak: " + report.probe_difference).c_str());
  if (!report.probe_non_finite.empty()) {
    std::fprintf(progress, "probe: %s\n", report.probe_non_finite.c_str());
  }
  if (report.memory_end >= 0) {
    std::fprintf(progress,
                 "device memory in use: %.1f MiB before, %.1f MiB after (%+.1f MiB, "
                 "tolerance %lld MiB): %s\n",
                 mib(static_cast<double>(report.memory_start)),
                 mib(static_cast<double>(report.memory_end)), mib(static_cast<double>(growth)),
                 static_cast<long long>(args.memory_tolerance_mib), memory_flat ? "flat" : "GREW");
  }
  if (report.window > 0) {
    std::fprintf(progress,
                 "time per step: median %.3f ms over the first %lld steps, %.3f ms over "
                 "the last %lld: %+.1f %% (limit %lld %%)%s; median of all %.3f ms\n",
                 report.first_ms, static_cast<long long>(report.window), report.last_ms,
                 static_cast<long long>(report.window), report.drift_percent,
                 static_cast<long long>(args.drift_limit_percent),
                 drift_flagged ? ": DRIFT (flagged, not failed)" : "", report.median_ms);
  }
  std::fprintf(progress, "device faults: %s\n",
               report.error.empty()
                   ? concat("none recorded (checked every ", args.check_every, " steps)").c_str()
                   : report.error.c_str());
  std::fprintf(progress, "soak: %s after %lld of %lld steps in %.1f s\n",
               passed ? "PASSED" : "FAILED", static_cast<long long>(report.steps_done),
               static_cast<long long>(args.steps), report.seconds);
  std::fflush(progress);

  char date[32];
  const std::time_t now = std::time(nullptr);
  std::strftime(date, sizeof(date), "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
  const char* commit = std::getenv("MOK_COMMIT");
  std::string json =
      concat("{\"schema\": \"mok-soak/1\", \"commit\": ", json_string(commit ? commit : "unknown"),
             ", \"device\": ", json_string(properties.name), ", \"date\": \"", date, "\",\n",
             " \"shape\": {\"hidden\": ", shape.hidden, ", \"intermediate\": ", shape.intermediate,
             ", \"shared_intermediate\": ", shape.shared_intermediate,
             ", \"num_experts\": ", shape.num_experts, ", \"top_k\": ", shape.top_k,
             "}, \"tokens\": ", args.tokens, ", \"seed\": ", args.seed, ",\n \"routings\": [");
  for (int routing = 0; routing < kNumRoutings; ++routing) {
    json += concat(routing == 0 ? "" : ", ", "\"", kRoutingNames[routing], "\"");
  }
  char figures[512];
  std::snprintf(figures, sizeof(figures),
                "\"ms_per_step\": {\"window\": %lld, \"first_window_median\": %.4f, "
                "\"last_window_median\": %.4f, \"median\": %.4f, \"drift_percent\": %.2f, "
                "\"drift_limit_percent\": %lld, \"drift_flagged\": %s}",
                static_cast<long long>(report.window), report.first_ms, report.last_ms,
                report.median_ms, report.drift_percent,
                static_cast<long long>(args.drift_limit_percent), drift_flagged ? "true" : "false");
  json += concat("], \"steps\": ", args.steps, ", \"steps_done\": ", report.steps_done,
                 ", \"check_every\": ", args.check_every,
                 ",\n \"probe\": {\"compared\": ", report.probe_compared ? "true" : "false",
                 ", \"bitwise_equal\": ", probe_equal ? "true" : "false",
                 ", \"first_difference\": ", json_string(report.probe_difference),
                 ", \"non_finite\": ", json_string(report.probe_non_finite),
                 "},\n \"device_memory\": {\"start_bytes\": ", report.memory_start,
                 ", \"end_bytes\": ", report.memory_end, ", \"tolerance_bytes\": ", tolerance,
                 ", \"flat\": ", memory_flat ? "true" : "false", "},\n ", figures,
                 ",\n \"error\": ", json_string(report.error), ", \"seconds\": ", report.seconds,
                 ", \"passed\": ", passed ? "true" : "false", "}\n");
  const bool written = std::fputs(json.c_str(), out.get()) >= 0 && std::fflush(out.get()) == 0;
  MOK_CHECK_ARG(written && !std::ferror(out.get()), "--out", "writing '", args.out,
                "' failed: ", std::strerror(errno));
  return passed ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  return mok::bench::run_main("bench_soak", [&] { return run(argc, argv); });
}
