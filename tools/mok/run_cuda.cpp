// mok run --backend cuda: the fused GPU layer forward on every rank's GPU, timed, and checked
// against the CPU reference on a sample of tokens (and, for EP > 1, bitwise against EP = 1).
#include "run_cuda.hpp"

#include <algorithm>
#include <cstdio>

#include "mok/compare.hpp"
#include "mok/error.hpp"
#if defined(MOK_WITH_CUDA)
#include <cuda_runtime.h>

#include "runtime/device.hpp"
#include "runtime/l2_partitions.hpp"
#include "runtime/layer_runner.hpp"
#endif

namespace mok::cli {

#if defined(MOK_WITH_CUDA)

namespace {

constexpr int64_t kMinSampleTokens = 256;

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
  for (int64_t token = 0; token < problem.num_tokens && static_cast<int64_t>(tokens.size()) < wanted;
       token += stride) {
    if (!chosen[token]) {
      chosen[token] = 1;
      tokens.push_back(token);
    }
  }
  std::sort(tokens.begin(), tokens.end());
  return tokens;
}

// y of the sampled tokens by the CPU reference (EP = 1, all experts; the same math as any EP).
std::vector<bf16> reference_sample_y(const Problem& problem, const std::vector<int64_t>& tokens) {
  const LayerShape& shape = problem.shape;
  const int64_t count = static_cast<int64_t>(tokens.size()), hidden = shape.hidden, top_k = shape.top_k;
  std::vector<bf16> x(static_cast<size_t>(count * hidden)), y(x.size());
  std::vector<int32_t> idx(static_cast<size_t>(count * top_k));
  std::vector<float> w(idx.size());
  for (int64_t row = 0; row < count; ++row) {
    std::copy_n(problem.x.begin() + tokens[row] * hidden, hidden, x.begin() + row * hidden);
    std::copy_n(problem.topk_idx.begin() + tokens[row] * top_k, top_k, idx.begin() + row * top_k);
    std::copy_n(problem.topk_w.begin() + tokens[row] * top_k, top_k, w.begin() + row * top_k);
  }
  reference::RankInputs inputs = problem.rank_inputs(0, 1);
  inputs.tokens = {View<const bf16>(x.data(), {count, hidden}),
                   View<const int32_t>(idx.data(), {count, top_k}),
                   View<const float>(w.data(), {count, top_k})};
  inputs.dy = inputs.tokens.x;
  reference::RankOutputs outputs;
  outputs.y = View<bf16>(y.data(), {count, hidden});
  reference::forward(shape, std::span<const reference::RankInputs>(&inputs, 1),
                     std::span<const reference::RankOutputs>(&outputs, 1));
  return y;
}

bool check_gpu_result(const RunConfig& config, const Problem& problem, const std::vector<bf16>& y) {
  int64_t experts_covered = 0;
  const std::vector<int64_t> tokens = sample_tokens(problem, &experts_covered);
  const int64_t hidden = problem.shape.hidden;
  std::printf("check: y of %zu of the %lld tokens (every one of the %lld experts that received "
              "tokens is used by at least one; the rest evenly spaced) against the CPU reference "
              "computed for those tokens (pass: rel-L2 <= %.0e, every element written):\n",
              tokens.size(), static_cast<long long>(problem.num_tokens),
              static_cast<long long>(experts_covered), kBf16Tolerance);
  std::fflush(stdout);
  const std::vector<bf16> expected = reference_sample_y(problem, tokens);
  std::vector<bf16> actual(expected.size());
  std::vector<double> expected_values(expected.size());
  for (size_t row = 0; row < tokens.size(); ++row) {
    std::copy_n(y.begin() + tokens[row] * hidden, hidden, actual.begin() + row * hidden);
  }
  for (size_t index = 0; index < expected.size(); ++index) {
    expected_values[index] = expected[index].to_float();
  }
  const ErrorStats stats = compare(std::span<const bf16>(actual), expected_values);
  bool passed = stats.within(kBf16Tolerance);
  std::printf("  %-18s %s  %s\n", "y (sample)", stats.describe().c_str(), passed ? "ok" : "FAIL");

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
    const std::vector<bf16> y_single = run_layer_forward(single).y;
    const bool equal = y_single.size() == y.size() &&
                       std::equal(y.begin(), y.end(), y_single.begin(),
                                  [](bf16 a, bf16 b) { return a.bits == b.bits; });
    std::printf("  EP %lld vs EP 1 on the GPU: y (all %lld tokens) bitwise %s\n",
                static_cast<long long>(config.ep), static_cast<long long>(problem.num_tokens),
                equal ? "equal" : "DIFFERENT");
    passed &= equal;
  }
  return passed;
}

}  // namespace

std::string cuda_backend_unfit_reason(const RunConfig& config) {
  return gpu_layer_unfit_reason(config.shape, static_cast<int>(config.ep), config.tokens_per_rank);
}

std::string cuda_device_description() {
  const runtime::GpuSummary gpus = runtime::query_gpus();
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
  const LayerRunResult run = run_layer_forward(spec);
  result.forward_ms = run.forward_ms;
  result.has_backward = false;
  result.times_per_rank = true;
  result.device = cuda_device_description();
  result.outputs = ProblemOutputs{};
  result.outputs.ep = config.ep;
  result.outputs.y = run.y;
  std::printf("GPU forward: median of %d after %d warm-up, slowest of %lld rank(s); per rank "
              "%.2f GB weights + %.2f GB workspace and buffers\n",
              spec.iterations, spec.warmup, static_cast<long long>(config.ep),
              run.weight_bytes_per_rank / 1e9, run.buffer_bytes_per_rank / 1e9);
  print_timings(config, result);
  std::puts("bwd      not run: the GPU backward is not built yet (mok run --backend cpu runs it)");
  // The fused kernel hands its tasks out per L2 partition; the layer probed the map when it was
  // built (kept for the process, so this reads it).
  if (cudaSetDevice(0) == cudaSuccess) {
    const runtime::L2PartitionMap& map = runtime::l2_partition_map();
    if (map.num_partitions == 2) {
      std::printf("GPU 0 L2 partitions (probed): %d + %d SMs; fused tasks go out per partition\n",
                  map.sms_per_partition[0], map.sms_per_partition[1]);
    } else {
      std::puts("GPU 0 L2 partitions (probed): one found; fused tasks go out from one pool");
    }
  }
  return config.check ? check_gpu_result(config, problem, run.y) : true;
}

#else

std::string cuda_backend_unfit_reason(const RunConfig&) { return "this build has no CUDA backend"; }
std::string cuda_device_description() { return "this build has no CUDA backend"; }
bool run_cuda(const RunConfig&, const Problem&, RunResult&) {
  throw Error("--backend", "this build has no CUDA backend");
}

#endif

}  // namespace mok::cli
