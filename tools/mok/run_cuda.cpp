// mok run --backend cuda: the fused GPU layer forward and the GPU backward on every rank's GPU,
// timed, and checked against the CPU reference on a sample of tokens (y, dx, d_topk_w; the weight
// gradients too where the whole CPU backward is quick) and, for EP > 1, bitwise against EP = 1.
// --precision fp8 or mxfp8: the GPU layer in that FP8 mode (forward, and the training step from
// the weights' quantization on), checked against the CPU reference's same mode on the sample (y,
// dx, d_topk_w; the GPU tests check the FP8 modes' weight gradients) and, for EP > 1, bitwise
// against EP = 1.
#include "run_cuda.hpp"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <string>
#include <type_traits>

#include "mok/compare.hpp"
#include "mok/error.hpp"
#include "mok/precision.hpp"
#if defined(MOK_WITH_CUDA)
#include <cuda_runtime.h>

#include "mok/gemm.hpp"
#include "mok/gpu.hpp"
#include "mok/layer_runner.hpp"
#endif

namespace mok::cli {

#if defined(MOK_WITH_CUDA)

namespace {

constexpr int64_t kMinSampleTokens = 256;
// An FP8 mode, GPU against the CPU reference's same mode (rel-L2): the GPU tests measured fp8's y
// 0.003-0.004 apart (python/tests/test_torch_cuda_fp8.py) beside errors of ~0.064 against fp64;
// mxfp8 sums the same exact products in another order, as fp8 does.
constexpr double kFp8SampleTolerance = 2e-2;

// Tokens to check: first, in token order, every token that uses an expert no earlier pick uses
// (so each expert that received tokens — every local expert of every rank — is checked), then
// evenly spaced tokens up to kMinSampleTokens. Sorted.
std::vector<int64_t> sample_tokens(const Problem& problem, int64_t* experts_covered) {
  const int64_t top_k = problem.shape.top_k;
  std::vector<char> covered(static_cast<size_t>(problem.shape.num_experts), 0);
  std::vector<char> chosen(static_cast<size_t>(problem.num_tokens), 0);
  std::vector<int64_t> tokens;
  *experts_covered = 0;
  for (int64_t token = 0; token < problem.num_tokens; ++token) {
    bool new_expert = false;
    for (int64_t slot = 0; slot < top_k; ++slot) {
      const int32_t expert = problem.topk_idx[token * top_k + slot];
      new_expert |= expert >= 0 && !covered[expert];
    }
    if (!new_expert) continue;
    for (int64_t slot = 0; slot < top_k; ++slot) {
      const int32_t expert = problem.topk_idx[token * top_k + slot];
      if (expert >= 0 && !covered[expert]) {
        covered[expert] = 1;
        ++*experts_covered;
      }
    }
    chosen[token] = 1;
    tokens.push_back(token);
  }
  const int64_t wanted = std::min(problem.num_tokens, kMinSampleTokens);
  const int64_t stride = std::max<int64_t>(1, problem.num_tokens / wanted);
  for (int64_t token = 0;
       token < problem.num_tokens && static_cast<int64_t>(tokens.size()) < wanted;
       token += stride) {
    if (!chosen[token]) {
      chosen[token] = 1;
      tokens.push_back(token);
    }
  }
  std::sort(tokens.begin(), tokens.end());
  return tokens;
}

// The sampled tokens as a problem of their own (EP = 1, all experts): y, dx and d_topk_w of a
// token depend on its own row alone, so the CPU reference computes them for the sample exactly as
// for the whole batch.
struct SampleOutputs {
  std::vector<bf16> y, dx;
  std::vector<float> d_topk_w;
};

SampleOutputs reference_sample(const Problem& problem, const std::vector<int64_t>& tokens,
                               bool backward, Precision precision) {
  const LayerShape& shape = problem.shape;
  const int64_t count = static_cast<int64_t>(tokens.size()), hidden = shape.hidden,
                top_k = shape.top_k;
  std::vector<bf16> x(static_cast<size_t>(count * hidden)), dy(x.size());
  std::vector<int32_t> idx(static_cast<size_t>(count * top_k));
  std::vector<float> w(idx.size());
  for (int64_t row = 0; row < count; ++row) {
    std::copy_n(problem.x.begin() + tokens[row] * hidden, hidden, x.begin() + row * hidden);
    std::copy_n(problem.dy.begin() + tokens[row] * hidden, hidden, dy.begin() + row * hidden);
    std::copy_n(problem.topk_idx.begin() + tokens[row] * top_k, top_k, idx.begin() + row * top_k);
    std::copy_n(problem.topk_w.begin() + tokens[row] * top_k, top_k, w.begin() + row * top_k);
  }
  reference::RankInputs inputs = problem.rank_inputs(0, 1);
  inputs.tokens = {View<const bf16>(x.data(), {count, hidden}),
                   View<const int32_t>(idx.data(), {count, top_k}),
                   View<const float>(w.data(), {count, top_k})};
  inputs.dy = View<const bf16>(dy.data(), {count, hidden});
  SampleOutputs sample;
  sample.y.resize(x.size());
  reference::RankOutputs outputs;
  outputs.y = View<bf16>(sample.y.data(), {count, hidden});
  const std::span<const reference::RankInputs> ranks(&inputs, 1);
  reference::Options options;
  options.precision = precision;
  reference::forward(shape, ranks, std::span<const reference::RankOutputs>(&outputs, 1), options);
  if (!backward) return sample;
  // The weight gradients of the sample are computed too (the reference has no way to skip them).
  sample.dx.resize(x.size());
  sample.d_topk_w.resize(idx.size());
  std::vector<float> gate(problem.gate.size()), up(gate.size()), down(problem.down.size());
  std::vector<float> shared_gate(problem.shared_gate.size()), shared_up(shared_gate.size());
  std::vector<float> shared_down(problem.shared_down.size());
  outputs.dx = View<bf16>(sample.dx.data(), {count, hidden});
  outputs.d_topk_w = View<float>(sample.d_topk_w.data(), {count, top_k});
  const int64_t experts = shape.num_experts, inter = shape.intermediate;
  const int64_t shared_inter = shape.shared_intermediate;
  outputs.grads.gate = View<float>(gate.data(), {experts, inter, hidden});
  outputs.grads.up = View<float>(up.data(), {experts, inter, hidden});
  outputs.grads.down = View<float>(down.data(), {experts, hidden, inter});
  outputs.grads.shared_gate = View<float>(shared_gate.data(), {shared_inter, hidden});
  outputs.grads.shared_up = View<float>(shared_up.data(), {shared_inter, hidden});
  outputs.grads.shared_down = View<float>(shared_down.data(), {hidden, shared_inter});
  reference::backward(shape, ranks, std::span<const reference::RankOutputs>(&outputs, 1),
                      GradMode::kOverwrite, options);
  return sample;
}

// How far the GPU may be from the CPU reference on the sample (rel-L2). bf16: the same rounding
// points, sums in another order. The FP8 modes: the same, where a sum a few ulps off can move an
// element across an E4M3 rounding boundary (the GPU tests bound them against the fp64 oracle).
double sample_tolerance(Precision precision) {
  return precision == Precision::kBf16 ? kBf16Tolerance : kFp8SampleTolerance;
}

template <class T>
bool print_sample_error(const char* name, const std::vector<T>& all, const std::vector<T>& expected,
                        const std::vector<int64_t>& tokens, int64_t width, double tolerance) {
  std::vector<T> actual(expected.size());
  std::vector<double> expected_values(expected.size());
  for (size_t row = 0; row < tokens.size(); ++row) {
    std::copy_n(all.begin() + tokens[row] * width, width, actual.begin() + row * width);
  }
  for (size_t index = 0; index < expected.size(); ++index) {
    if constexpr (std::is_same_v<T, bf16>) {
      expected_values[index] = expected[index].to_float();
    } else {
      expected_values[index] = expected[index];
    }
  }
  const ErrorStats stats = compare(std::span<const T>(actual), expected_values);
  const bool passed = stats.within(tolerance);
  std::printf("  %-18s %s  %s\n", name, stats.describe().c_str(), passed ? "ok" : "FAIL");
  return passed;
}

template <class T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

// The whole CPU backward runs for the weight gradients' check when it is this cheap (multiply-adds
// of forward and backward; a few seconds on a few cores).
constexpr double kFullCheckMaxFlops = 2e10;

bool check_gpu_result(const RunConfig& config, const Problem& problem, const LayerRunResult& run,
                      const ProblemOutputs& gpu) {
  int64_t experts_covered = 0;
  const std::vector<int64_t> tokens = sample_tokens(problem, &experts_covered);
  const LayerShape& shape = problem.shape;
  const bool fp8 = config.precision != Precision::kBf16;  // an FP8 mode: fp8 or mxfp8
  const std::string precision(precision_name(config.precision));
  const double tolerance = sample_tolerance(config.precision);
  std::printf(
      "check: y, dx and d_topk_w of %zu of the %lld tokens (every one of the %lld experts "
      "that received tokens is used by at least one; the rest evenly spaced) against the "
      "CPU reference%s%s computed for those tokens (pass: rel-L2 <= %.0e, every element "
      "written):\n",
      tokens.size(), static_cast<long long>(problem.num_tokens),
      static_cast<long long>(experts_covered), fp8 ? " in " : "", fp8 ? precision.c_str() : "",
      tolerance);
  std::fflush(stdout);
  const SampleOutputs expected = reference_sample(problem, tokens, true, config.precision);
  bool passed =
      print_sample_error("y (sample)", gpu.y, expected.y, tokens, shape.hidden, tolerance);
  passed &= print_sample_error("dx (sample)", gpu.dx, expected.dx, tokens, shape.hidden, tolerance);
  passed &= print_sample_error("d_topk_w (sample)", gpu.d_topk_w, expected.d_topk_w, tokens,
                               shape.top_k, tolerance);

  const double flops = 18.0 * static_cast<double>(problem.num_tokens) * shape.hidden *
                       (shape.top_k * shape.intermediate + shape.shared_intermediate);
  if (fp8) {
    std::printf(
        "  weight gradients: not compared here in %s (the GPU tests check them against the "
        "CPU reference and the fp64 oracle)\n",
        precision.c_str());
  } else if (flops <= kFullCheckMaxFlops) {
    // Every weight gradient against the CPU reference's, at the same EP.
    ProblemOutputs cpu = ProblemOutputs::poisoned(problem, config.ep);
    reference::backward(shape, problem.all_rank_inputs(config.ep), cpu.rank_outputs(problem),
                        GradMode::kOverwrite);
    auto grads = [&](const char* name, const std::vector<float>& value,
                     const std::vector<float>& ref) {
      std::vector<double> expected_values(ref.begin(), ref.end());
      const ErrorStats stats = compare(std::span<const float>(value), expected_values);
      const bool ok = stats.within(kBf16Tolerance);
      std::printf("  %-18s %s  %s\n", name, stats.describe().c_str(), ok ? "ok" : "FAIL");
      return ok;
    };
    passed &= grads("grad_gate", gpu.grad_gate, cpu.grad_gate);
    passed &= grads("grad_up", gpu.grad_up, cpu.grad_up);
    passed &= grads("grad_down", gpu.grad_down, cpu.grad_down);
    if (shape.has_shared()) {
      passed &= grads("grad_shared_gate", gpu.grad_shared_gate, cpu.grad_shared_gate);
      passed &= grads("grad_shared_up", gpu.grad_shared_up, cpu.grad_shared_up);
      passed &= grads("grad_shared_down", gpu.grad_shared_down, cpu.grad_shared_down);
    }
  } else {
    std::printf(
        "  weight gradients: not compared here (the whole CPU backward would take %.0e "
        "multiply-adds; the GPU tests check them on smaller layers)\n",
        flops / 2);
  }

  if (config.ep > 1) {
    LayerRunSpec single;
    single.shape = problem.shape;
    single.ep = 1;
    single.tokens_per_rank = problem.num_tokens;
    single.topk_idx = &problem.topk_idx;
    single.topk_w = &problem.topk_w;
    single.problem = &problem;
    single.warmup = 0;
    single.iterations = 1;
    single.backward = true;
    single.fp8_forward = fp8;
    if (fp8) single.fp8_precision = config.precision;
    const LayerRunResult one = run_layer_forward(single);
    const bool equal = fp8 ? same_bits(one.fp8_y, run.fp8_y) && same_bits(one.fp8_dx, run.fp8_dx) &&
                                 same_bits(one.fp8_d_topk_w, run.fp8_d_topk_w)
                           : same_bits(one.y, run.y) && same_bits(one.dx, run.dx) &&
                                 same_bits(one.d_topk_w, run.d_topk_w) &&
                                 same_bits(one.grad_gate_up, run.grad_gate_up) &&
                                 same_bits(one.grad_down, run.grad_down);
    std::printf("  EP %lld vs EP 1 on the GPU: y, dx, d_topk_w%s bitwise %s\n",
                static_cast<long long>(config.ep), fp8 ? "" : ", routed weight gradients (all)",
                equal ? "equal" : "DIFFERENT");
    passed &= equal;
  }
  return passed;
}

}  // namespace

std::string cuda_backend_unfit_reason(const RunConfig& config) {
  const bool fp8 = config.precision != Precision::kBf16;
  return gpu_layer_unfit_reason(config.shape, static_cast<int>(config.ep), config.tokens_per_rank,
                                /*backward=*/true, fp8, config.precision);
}

std::string cuda_device_description() {
  const GpuSummary gpus = query_gpus();
  return gpus.description;
}

bool run_cuda(const RunConfig& config, const Problem& problem, RunResult& result) {
  LayerRunSpec spec;
  spec.shape = config.shape;
  spec.ep = static_cast<int>(config.ep);
  spec.tokens_per_rank = config.tokens_per_rank;
  spec.topk_idx = &problem.topk_idx;
  spec.topk_w = &problem.topk_w;
  spec.problem = &problem;
  spec.backward = true;
  const bool fp8 = config.precision != Precision::kBf16;  // an FP8 mode: fp8 or mxfp8
  spec.fp8_forward = fp8;  // (after the bf16 forward, as bench_layer runs it)
  if (fp8) spec.fp8_precision = config.precision;
  spec.chunked_backward = config.low_memory_backward;
  const LayerRunResult run = run_layer_forward(spec);
  result.forward_ms = fp8 ? run.fp8_forward_ms : run.forward_ms;
  result.backward_ms = fp8 ? run.fp8_backward_ms : run.backward_ms;
  result.has_backward = true;
  result.times_per_rank = true;
  result.device = cuda_device_description();
  result.outputs = ProblemOutputs{};
  ProblemOutputs& outputs = result.outputs;
  outputs.ep = config.ep;
  outputs.y = fp8 ? run.fp8_y : run.y;
  outputs.dx = fp8 ? run.fp8_dx : run.dx;
  outputs.d_topk_w = fp8 ? run.fp8_d_topk_w : run.d_topk_w;
  const LayerShape& shape = config.shape;
  if (!fp8) {  // (the FP8 modes' step keeps no weight gradients for the host)
    gemm::split_gate_up(run.grad_gate_up, shape.num_experts, shape.intermediate, shape.hidden,
                        outputs.grad_gate, outputs.grad_up);
    outputs.grad_down = run.grad_down;
    if (shape.has_shared()) {
      gemm::split_gate_up(run.grad_shared_gate_up, config.ep, shape.shared_intermediate,
                          shape.hidden, outputs.grad_shared_gate, outputs.grad_shared_up);
      outputs.grad_shared_down = run.grad_shared_down;
    }
  }
  std::printf(
      "GPU forward and backward: medians of %d after %d warm-up, slowest of %lld rank(s); "
      "per rank %.2f GB weights + %.2f GB forward and %.2f GB backward workspace and "
      "buffers; the backward is timed right after a forward (pairs), the forward alone\n",
      spec.iterations, spec.warmup, static_cast<long long>(config.ep),
      run.weight_bytes_per_rank / 1e9,
      (fp8 ? run.fp8_buffer_bytes_per_rank : run.buffer_bytes_per_rank) / 1e9,
      (fp8 ? run.fp8_backward_buffer_bytes_per_rank : run.backward_buffer_bytes_per_rank) / 1e9);
  print_timings(config, result);
  if (fp8) {
    std::printf(
        "%s training step (weights quantized into a %.2f GB cache in both layouts, forward, "
        "backward): %.3f ms/rank; mok bf16 in the same run: forward %.3f, step %.3f ms/rank\n",
        std::string(precision_name(config.precision)).c_str(), run.fp8_weight_bytes_per_rank / 1e9,
        run.fp8_step_ms, run.forward_ms, run.forward_backward_ms);
  } else {
    std::printf("fwd+bwd as timed pairs: %.3f ms/rank\n", run.forward_backward_ms);
  }
  if (config.low_memory_backward) {
    std::printf(
        "low-memory backward (chunks of 1.5 T rows): backward %.3f ms/rank, fwd+bwd %.3f ms/rank, "
        "%.2f GB backward buffers; outputs %s the default backward's\n",
        run.backward_chunked_ms, run.forward_backward_chunked_ms,
        run.backward_chunked_buffer_bytes_per_rank / 1e9,
        run.chunked_same_bits ? "bitwise equal to" : "DIFFERENT FROM");
  }
  std::printf("%s\n", run.l2_partitions.c_str());
  const bool chunked_passed = !config.low_memory_backward || run.chunked_same_bits;
  return (config.check ? check_gpu_result(config, problem, run, outputs) : true) && chunked_passed;
}

#else

std::string cuda_backend_unfit_reason(const RunConfig&) { return "this build has no CUDA backend"; }
std::string cuda_device_description() { return "this build has no CUDA backend"; }
bool run_cuda(const RunConfig&, const Problem&, RunResult&) {
  throw Error("--backend", "this build has no CUDA backend");
}

#endif

}  // namespace mok::cli
