#include "report.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <utility>

#ifndef MOK_GIT_COMMIT
#define MOK_GIT_COMMIT "unknown"
#endif

namespace mok::cli {

namespace {

double useful_tflops(double flops, double ms) { return ms > 0 ? flops / (ms * 1e-3) * 1e-12 : 0; }

struct Phase {
  const char* name;
  double ms;
  double flops;
};

std::vector<Phase> phases(const RunConfig& config, const RunResult& result) {
  // Per rank: forward 6·T·H·(k·I + I_s), backward twice that (DESIGN.md §5).
  const double forward_flops = static_cast<double>(config.tokens_per_rank) *
                               static_cast<double>(config.shape.forward_flops_per_token());
  if (!result.has_backward) return {{"fwd", result.forward_ms, forward_flops}};
  return {{"fwd", result.forward_ms, forward_flops},
          {"bwd", result.backward_ms, 2 * forward_flops},
          {"fwdbwd", result.forward_ms + result.backward_ms, 3 * forward_flops}};
}

double per_rank(const RunConfig& config, const RunResult& result, double ms) {
  return result.times_per_rank ? ms : ms / static_cast<double>(config.ep);
}

// The shared expert's gradient summed over ranks (each rank holds its own tokens' share).
std::vector<float> sum_over_ranks(const std::vector<float>& per_rank, int64_t ep) {
  const size_t size = per_rank.size() / static_cast<size_t>(ep);
  std::vector<float> total(size, 0.0f);
  for (int64_t rank = 0; rank < ep; ++rank) {
    for (size_t index = 0; index < size; ++index) total[index] += per_rank[rank * size + index];
  }
  return total;
}

// The oracle's tensors in the order of OracleCheck::lines.
using OracleField = std::vector<double> reference::OracleResult::*;
constexpr OracleField kOracleFields[] = {
    &reference::OracleResult::y,
    &reference::OracleResult::dx,
    &reference::OracleResult::d_topk_w,
    &reference::OracleResult::grad_gate,
    &reference::OracleResult::grad_up,
    &reference::OracleResult::grad_down,
    &reference::OracleResult::grad_shared_gate,
    &reference::OracleResult::grad_shared_up,
    &reference::OracleResult::grad_shared_down,
};

}  // namespace

void print_timings(const RunConfig& config, const RunResult& result) {
  // The CPU backend runs all R virtual ranks one after another: time per rank is time / R.
  for (const Phase& phase : phases(config, result)) {
    const double per_rank_ms = per_rank(config, result, phase.ms);
    std::printf("%-8s %12.2f ms/rank  %10.4f useful TFLOP/s  %12.0f tokens/s/rank\n", phase.name,
                per_rank_ms, useful_tflops(phase.flops, per_rank_ms),
                static_cast<double>(config.tokens_per_rank) / (per_rank_ms * 1e-3));
  }
  std::printf("checksum %016llx\n", static_cast<unsigned long long>(checksum(result.outputs)));
}

bool OracleCheck::Line::passed(Precision precision, int64_t tokens) const {
  if (precision == Precision::kBf16) return stats.within(bf16_tolerance(tokens));
  if (stats.non_finite != 0) return false;
  return tokens < kFp8JudgedTokens ||
         std::fabs(stats.relative_l2 - yardstick) <= fp8_yardstick_margin(tokens) * yardstick;
}

OracleCheck check_against_oracle(const RunConfig& config, const Problem& problem,
                                 const RunResult& result, const reference::Options& ep1_options,
                                 const reference::Options& oracle_options,
                                 const reference::Options& yardstick_options) {
  const std::vector<reference::RankInputs> whole = problem.all_rank_inputs(1);
  OracleCheck check;
  if (config.ep > 1) {
    ProblemOutputs single = ProblemOutputs::poisoned(problem, 1);
    const std::vector<reference::RankOutputs> views = single.rank_outputs(problem);
    reference::forward(problem.shape, whole, views, ep1_options);
    reference::backward(problem.shape, whole, views, GradMode::kOverwrite, ep1_options);
    check.ep_compared = true;
    check.ep1_checksum = checksum(single);
    check.ep_equal = check.ep1_checksum == checksum(result.outputs) &&
                     single.y.size() == result.outputs.y.size();
  }

  reference::Options exact_options = oracle_options;
  exact_options.precision = Precision::kBf16;  // bf16's oracle: no quantization at all
  const reference::OracleResult oracle =
      std::move(reference::oracle(problem.shape, whole, true, exact_options)[0]);
  const ProblemOutputs& out = result.outputs;
  auto add = [&check](const char* name, ErrorStats stats) { check.lines.push_back({name, stats}); };
  add("y", compare(std::span<const bf16>(out.y), oracle.y));
  add("dx", compare(std::span<const bf16>(out.dx), oracle.dx));
  add("d_topk_w", compare(std::span<const float>(out.d_topk_w), oracle.d_topk_w));
  add("grad_gate", compare(std::span<const float>(out.grad_gate), oracle.grad_gate));
  add("grad_up", compare(std::span<const float>(out.grad_up), oracle.grad_up));
  add("grad_down", compare(std::span<const float>(out.grad_down), oracle.grad_down));
  if (problem.shape.has_shared()) {
    const std::vector<float> gate = sum_over_ranks(out.grad_shared_gate, config.ep);
    const std::vector<float> up = sum_over_ranks(out.grad_shared_up, config.ep);
    const std::vector<float> down = sum_over_ranks(out.grad_shared_down, config.ep);
    add("grad_shared_gate", compare(std::span<const float>(gate), oracle.grad_shared_gate));
    add("grad_shared_up", compare(std::span<const float>(up), oracle.grad_shared_up));
    add("grad_shared_down", compare(std::span<const float>(down), oracle.grad_shared_down));
  }
  if (config.precision == Precision::kBf16) return check;

  reference::Options quantized_options = yardstick_options;
  quantized_options.precision = config.precision;
  const reference::OracleResult yardstick =
      std::move(reference::oracle(problem.shape, whole, true, quantized_options)[0]);
  for (size_t index = 0; index < check.lines.size(); ++index) {
    const auto field = kOracleFields[index];
    check.lines[index].yardstick = compare(yardstick.*field, oracle.*field).relative_l2;
  }
  return check;
}

bool print_check(const RunConfig& config, const OracleCheck& check) {
  const int64_t tokens = config.tokens_per_rank * config.ep;
  if (config.precision == Precision::kBf16) {
    std::printf(
        "check against the fp64 oracle (pass: rel-L2 <= %.0e + 0.06 / sqrt(tokens) = %.2e at %lld "
        "tokens, every element written):\n",
        kBf16Tolerance, bf16_tolerance(tokens), static_cast<long long>(tokens));
  } else if (tokens >= kFp8JudgedTokens) {
    std::printf(
        "check against the fp64 oracle (pass: rel-L2 within %.0f %% + 40 %% / sqrt(tokens) = "
        "%.1f %% at %lld tokens of the quantize-then-fp64 yardstick's, every element written):\n",
        kFp8YardstickTolerance * 100, fp8_yardstick_margin(tokens) * 100,
        static_cast<long long>(tokens));
  } else {
    std::printf(
        "check against the fp64 oracle (pass: every element written; the errors are shown, not "
        "judged: below %lld tokens an FP8 error scatters too far to tell a wrong quantization "
        "from chance):\n",
        static_cast<long long>(kFp8JudgedTokens));
  }
  bool passed = true;
  for (const OracleCheck::Line& line : check.lines) {
    const bool line_passed = line.passed(config.precision, tokens);
    if (config.precision == Precision::kBf16) {
      std::printf("  %-18s %s  %s\n", line.name, line.stats.describe().c_str(),
                  line_passed ? "ok" : "FAIL");
    } else {
      const bool judged = tokens >= kFp8JudgedTokens;
      std::printf("  %-18s %s (yardstick %.2e)  %s\n", line.name, line.stats.describe().c_str(),
                  line.yardstick,
                  line_passed ? (judged ? "ok" : "written") : (judged ? "FAIL" : "NOT WRITTEN"));
    }
    passed &= line_passed;
  }
  if (check.ep_compared) {
    std::printf("  EP %lld vs EP 1: y, dx, d_topk_w, routed grads bitwise %s (checksum %016llx)\n",
                static_cast<long long>(config.ep), check.ep_equal ? "equal" : "DIFFERENT",
                static_cast<unsigned long long>(check.ep1_checksum));
    passed &= check.ep_equal;
  }
  return passed;
}

std::string json_record(const RunConfig& config, const RunResult& result) {
  char date[32];
  const std::time_t now = std::time(nullptr);
  std::strftime(date, sizeof(date), "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
  const std::string preset = config.shape_flags.empty() ? config.preset : "custom";
  std::string text = "{\n  \"schema\": \"mok-bench/1\",\n  \"commit\": \"" MOK_GIT_COMMIT
                     "\",\n  \"device\": \"" +
                     result.device + "\",\n  \"date\": \"" + date + "\",\n  \"cases\": [\n";
  const std::vector<Phase> all = phases(config, result);
  for (size_t index = 0; index < all.size(); ++index) {
    const Phase& phase = all[index];
    const double per_rank_ms = per_rank(config, result, phase.ms);
    char line[640];
    std::snprintf(line, sizeof(line),
                  "    {\"name\": \"%s-ep%lld-%s\", \"preset\": \"%s\", \"ep\": %lld, "
                  "\"tokens_per_rank\": %lld, \"precision\": \"%s\", \"phase\": \"%s\", "
                  "\"backend\": \"%s\", \"routing\": \"%s\", \"mok_ms\": %.4f, \"baseline\": null, "
                  "\"baseline_ms\": null, \"speedup\": null, \"useful_tflops\": %.6f, "
                  "\"gbps\": null, \"dense_gemm_tflops\": null, \"checksum\": \"%016llx\"}%s\n",
                  preset.c_str(), static_cast<long long>(config.ep), phase.name, preset.c_str(),
                  static_cast<long long>(config.ep), static_cast<long long>(config.tokens_per_rank),
                  std::string(precision_name(config.precision)).c_str(), phase.name,
                  config.backend.c_str(), config.routing.name().c_str(), per_rank_ms,
                  useful_tflops(phase.flops, per_rank_ms),
                  static_cast<unsigned long long>(checksum(result.outputs)),
                  index + 1 < all.size() ? "," : "");
    text += line;
  }
  return text + "  ]\n}\n";
}

}  // namespace mok::cli
