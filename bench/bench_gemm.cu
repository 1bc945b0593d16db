// Benchmark of the grouped expert GEMMs at one rank of EP2 with balanced routing
// (2 ranks x 8192 tokens x top-8 = 65,536 rows over the rank's experts), per preset:
// gate/up (plain and SwiGLU-fused), down, dgrad and wgrad. Median of timed iterations with CUDA
// events after warm-up, on random (never zero) data. Every case runs on both engines, the
// cooperative and the ping-pong kernel, back to back (same clocks). Writes one JSON object per
// case and engine to --out; bench/baselines/torch_grouped_mm.py adds torch's figures measured in
// the same device run.
//
//   bench_gemm [--out FILE] [--iterations N] [--only PRESET/PHASE] [--engine cooperative|pingpong]
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "bench_device.cuh"
#include "bench_options.hpp"
#include "mok/cuda_check.hpp"
#include "mok/gemm.hpp"
#include "mok/gpu.hpp"
#include "mok/shape.hpp"

namespace {

using namespace mok::gemm;

using Buffer = mok::bench::DeviceBytes;
using mok::bench::fill_random;

void fill(const Buffer& buffer, size_t count, uint32_t seed, float scale) {
  fill_random<<<1024, 256>>>(static_cast<__nv_bfloat16*>(buffer.data), count, seed, scale);
  MOK_CUDA_CHECK_LAUNCH();
}

using mok::bench::median_ms;
using mok::bench::warm_up;

// The SwiGLU epilogue's cost: the plain and the SwiGLU-fused gate/up launched alternately (AB BA
// AB ...), each launch (or block of `block` launches) timed on its own, so that both see the same
// clocks and temperature; a back-to-back median of each, minutes apart, moved the ratio between
// runs by more than the epilogue costs (docs/perf-notes/gemm.md). Longer blocks let each kernel's
// own power draw set the clock it runs at.
struct PairTimes {
  double plain_ms, swiglu_ms;
};

PairTimes alternated_median_ms(const std::function<void()>& plain,
                               const std::function<void()>& swiglu, int pairs, int block) {
  const auto run = [block](const std::function<void()>& launch) {
    for (int i = 0; i < block; ++i) launch();
  };
  for (int i = 0; i < 3; ++i) {
    run(plain);
    run(swiglu);
  }
  MOK_CUDA_CHECK(cudaDeviceSynchronize());
  cudaEvent_t marks[3];
  for (cudaEvent_t& mark : marks) MOK_CUDA_CHECK(cudaEventCreate(&mark));
  std::vector<float> plain_times, swiglu_times;
  for (int i = 0; i < pairs; ++i) {
    const bool plain_first = i % 2 == 0;
    MOK_CUDA_CHECK(cudaEventRecord(marks[0]));
    run(plain_first ? plain : swiglu);
    MOK_CUDA_CHECK(cudaEventRecord(marks[1]));
    run(plain_first ? swiglu : plain);
    MOK_CUDA_CHECK(cudaEventRecord(marks[2]));
    MOK_CUDA_CHECK(cudaEventSynchronize(marks[2]));
    float first = 0.0f, second = 0.0f;
    MOK_CUDA_CHECK(cudaEventElapsedTime(&first, marks[0], marks[1]));
    MOK_CUDA_CHECK(cudaEventElapsedTime(&second, marks[1], marks[2]));
    plain_times.push_back((plain_first ? first : second) / block);
    swiglu_times.push_back((plain_first ? second : first) / block);
  }
  for (cudaEvent_t& mark : marks) MOK_CUDA_CHECK(cudaEventDestroy(mark));
  std::sort(plain_times.begin(), plain_times.end());
  std::sort(swiglu_times.begin(), swiglu_times.end());
  return {plain_times[plain_times.size() / 2], swiglu_times[swiglu_times.size() / 2]};
}

struct CaseResult {
  std::string preset, phase, engine;
  int num_experts, rows_per_expert, n, k;
  double ms, tflops;
};

constexpr const char* kPresets[] = {"deepseek-v3", "qwen3-30b-a3b", "qwen3-235b-a22b"};
constexpr const char* kPhases[] = {"gemm-gateup",       "gemm-gateup-swiglu", "gemm-down",
                                   "gemm-dgrad-gateup", "gemm-dgrad-down",    "gemm-wgrad-gateup",
                                   "gemm-wgrad-down"};

constexpr char kUsage[] =
    R"(bench_gemm: the grouped expert GEMMs of the benchmark presets at one rank of EP2, balanced
routing (65,536 rows over the rank's experts), on both GEMM engines; one Hopper GPU.

usage: bench_gemm [--out FILE] [--iterations N] [--warmup-ms MS] [--only PRESET/PHASE]
                  [--engine ENGINE]
       bench_gemm --swiglu-cost FILE [--iterations N] [--rounds R] [--block B] [--engine ENGINE]

  --out FILE           results, one JSON object per case and engine (default gemm-mok.json)
  --iterations N       timed iterations per case, median reported (default 20)
  --warmup-ms MS       untimed launches of each case for MS ms first, so that it is timed at the
                       clock its own power draw sets (default 300)
  --only PRESET/PHASE  one case, e.g. deepseek-v3/gemm-gateup (phases: gemm-gateup,
                       gemm-gateup-swiglu, gemm-down, gemm-dgrad-gateup, gemm-dgrad-down,
                       gemm-wgrad-gateup, gemm-wgrad-down)
  --engine ENGINE      cooperative or pingpong (default both)
  --swiglu-cost FILE   instead: the SwiGLU-fused gate/up against the plain one, launched
                       alternately, R rounds of N pairs per preset and engine; each round's
                       cost is the ratio of its two medians, the median round is reported
                       (JSON to FILE)
  --rounds R           rounds of --swiglu-cost (default 1)
  --block B            --swiglu-cost alternates blocks of B back-to-back launches of each
                       (default 1); each block is timed as a whole, the figures are per launch
)";

int run(int argc, char** argv) {
  std::string out_path = "gemm-mok.json", only, only_engine, swiglu_cost_path;
  int iterations = 20, rounds = 1, block = 1;
  double warmup_ms = 300;
  const bool go = mok::bench::parse_options(
      argc, argv, kUsage, [&](const std::string& name, const std::string& value) {
        if (name == "--out")
          out_path = value;
        else if (name == "--iterations")
          iterations = static_cast<int>(mok::bench::integer_option(name, value));
        else if (name == "--only")
          only = value;
        else if (name == "--engine")
          only_engine = value;
        else if (name == "--swiglu-cost")
          swiglu_cost_path = value;
        else if (name == "--rounds")
          rounds = static_cast<int>(mok::bench::integer_option(name, value));
        else if (name == "--block")
          block = static_cast<int>(mok::bench::integer_option(name, value));
        else if (name == "--warmup-ms")
          warmup_ms = static_cast<double>(mok::bench::integer_option(name, value));
        else
          return false;
        return true;
      });
  if (!go) return 0;
  if (iterations < 1) throw mok::bench::UsageError("--iterations", "must be >= 1");
  if (rounds < 1) throw mok::bench::UsageError("--rounds", "must be >= 1");
  if (block < 1) throw mok::bench::UsageError("--block", "must be >= 1");
  if (warmup_ms < 0) throw mok::bench::UsageError("--warmup-ms", "must be >= 0");
  if (!only_engine.empty() && only_engine != "cooperative" && only_engine != "pingpong") {
    throw mok::bench::UsageError("--engine",
                                 "expected cooperative or pingpong, got '" + only_engine + "'");
  }
  if (!swiglu_cost_path.empty() && !only.empty()) {
    throw mok::bench::UsageError("--only", "does not go with --swiglu-cost");
  }
  if (!only.empty()) {
    bool known = false;
    for (const char* preset : kPresets) {
      for (const char* phase : kPhases) known |= only == std::string(preset) + "/" + phase;
    }
    if (!known) throw mok::bench::UsageError("--only", "no case is called '" + only + "'");
  }
  const mok::GpuSummary gpus = mok::query_gpus();
  if (gpus.num_hopper_gpus < 1)
    throw mok::Error("", "needs a Hopper GPU; found " + gpus.description);
  constexpr int kEp = 2, kTokensPerRank = 8192;
  std::vector<CaseResult> results;
  std::string swiglu_cost_json;
  for (const char* preset_name : kPresets) {
    const mok::LayerShape& layer = mok::find_preset(preset_name).shape;
    const int experts = static_cast<int>(layer.num_experts / kEp);
    // Each rank sends k rows per token; balanced, half of all 2 x 8192 x k rows land on this rank.
    const int rows_total = static_cast<int>(kEp * kTokensPerRank * layer.top_k / kEp);
    const int rows = rows_total / experts;
    const int hidden = static_cast<int>(layer.hidden), inter = static_cast<int>(layer.intermediate);
    std::vector<int> offsets(experts + 1);
    for (int e = 0; e <= experts; ++e) offsets[e] = e * rows;
    Buffer offsets_device(offsets.size() * sizeof(int));
    MOK_CUDA_CHECK(cudaMemcpy(offsets_device.data, offsets.data(), offsets.size() * sizeof(int),
                              cudaMemcpyHostToDevice));
    const int* offs = static_cast<const int*>(offsets_device.data);
    const size_t rows_sz = rows_total;
    Buffer x(rows_sz * hidden * 2), w_gate_up(size_t(experts) * 2 * inter * hidden * 2),
        w_down(size_t(experts) * hidden * inter * 2), h(rows_sz * inter * 2),
        gate_up_out(rows_sz * 2 * inter * 2), down_out(rows_sz * hidden * 2),
        dw(size_t(experts) * 2 * inter * hidden * 2);
    fill(x, rows_sz * hidden, 1, 1.0f);
    fill(w_gate_up, size_t(experts) * 2 * inter * hidden, 2, 0.05f);
    fill(w_down, size_t(experts) * hidden * inter, 3, 0.05f);
    fill(h, rows_sz * inter, 4, 1.0f);
    fill(gate_up_out, rows_sz * 2 * inter, 5, 1.0f);  // doubles as dY of gate/up
    fill(down_out, rows_sz * hidden, 6, 1.0f);        // doubles as dY of down
    const GroupedShape gate_up{experts, rows_total, 2 * inter, hidden};
    const GroupedShape down{experts, rows_total, hidden, inter};
    struct Case {
      const char* phase;
      GroupedShape shape;
      std::function<void(const LaunchOptions&)> launch;
    };
    const std::vector<Case> cases = {
        {kPhases[0], gate_up,
         [&](const LaunchOptions& o) {
           grouped_forward(gate_up, x.bf16(), w_gate_up.bf16(), offs, gate_up_out.data,
                           ForwardOutput::kBf16, nullptr, o);
         }},
        {kPhases[1], gate_up,
         [&](const LaunchOptions& o) {
           grouped_forward(gate_up, x.bf16(), w_gate_up.bf16(), offs, h.data,
                           ForwardOutput::kSwiGluBf16, nullptr, o);
         }},
        {kPhases[2], down,
         [&](const LaunchOptions& o) {
           grouped_forward(down, h.bf16(), w_down.bf16(), offs, down_out.data, ForwardOutput::kBf16,
                           nullptr, o);
         }},
        {kPhases[3], gate_up,
         [&](const LaunchOptions& o) {
           grouped_dgrad(gate_up, gate_up_out.bf16(), w_gate_up.bf16(), offs, x.bf16(), nullptr, o);
         }},
        {kPhases[4], down,
         [&](const LaunchOptions& o) {
           grouped_dgrad(down, down_out.bf16(), w_down.bf16(), offs, h.bf16(), nullptr, o);
         }},
        {kPhases[5], gate_up,
         [&](const LaunchOptions& o) {
           grouped_wgrad(gate_up, gate_up_out.bf16(), x.bf16(), offs, dw.data, WgradOutput::kBf16,
                         nullptr, o);
         }},
        {kPhases[6], down,
         [&](const LaunchOptions& o) {
           grouped_wgrad(down, down_out.bf16(), h.bf16(), offs, dw.data, WgradOutput::kBf16,
                         nullptr, o);
         }},
    };
    const std::pair<const char*, GemmEngine> engines[] = {{"cooperative", GemmEngine::kCooperative},
                                                          {"pingpong", GemmEngine::kPingpong}};
    if (!swiglu_cost_path.empty()) {
      for (const auto& [engine_name, engine] : engines) {
        if (!only_engine.empty() && only_engine != engine_name) continue;
        LaunchOptions options;
        options.engine = engine;
        // One cost per round (the clocks the power cap leaves drift between rounds by more than
        // the epilogue costs on the short-K shapes); the median round is the figure.
        std::vector<PairTimes> round_times;
        std::string round_costs;
        for (int round = 0; round < rounds; ++round) {
          const PairTimes times =
              alternated_median_ms([&] { cases[0].launch(options); },
                                   [&] { cases[1].launch(options); }, iterations, block);
          const double cost = times.swiglu_ms / times.plain_ms - 1.0;
          std::printf("%-16s swiglu-cost  %-12s plain %8.3f ms  swiglu %8.3f ms  cost %+6.2f %%\n",
                      preset_name, engine_name, times.plain_ms, times.swiglu_ms, 100.0 * cost);
          std::fflush(stdout);
          round_times.push_back(times);
          char value[32];
          std::snprintf(value, sizeof(value), "%s%.5f", round == 0 ? "" : ", ", cost);
          round_costs += value;
        }
        std::sort(round_times.begin(), round_times.end(),
                  [](const PairTimes& a, const PairTimes& b) {
                    return a.swiglu_ms / a.plain_ms < b.swiglu_ms / b.plain_ms;
                  });
        const PairTimes& times = round_times[round_times.size() / 2];
        const double cost = times.swiglu_ms / times.plain_ms - 1.0;
        if (rounds > 1) {
          std::printf("%-16s swiglu-cost  %-12s median of %d rounds: cost %+6.2f %%\n", preset_name,
                      engine_name, rounds, 100.0 * cost);
        }
        char line[1024];
        std::snprintf(
            line, sizeof(line),
            "%s  {\"preset\": \"%s\", \"engine\": \"%s\", \"pairs\": %d, "
            "\"rounds\": %d, \"block\": %d, \"plain_ms\": %.5f, \"swiglu_ms\": %.5f, \"cost\": %.5f, "
            "\"round_costs\": [%s]}",
            swiglu_cost_json.empty() ? "" : ",\n", preset_name, engine_name, iterations, rounds,
            block, times.plain_ms, times.swiglu_ms, cost, round_costs.c_str());
        swiglu_cost_json += line;
      }
      MOK_CUDA_CHECK(cudaDeviceSynchronize());
      continue;
    }
    for (const Case& c : cases) {
      if (!only.empty() && only != std::string(preset_name) + "/" + c.phase) continue;
      for (const auto& [engine_name, engine] : engines) {
        if (!only_engine.empty() && only_engine != engine_name) continue;
        LaunchOptions options;
        options.engine = engine;
        const double ms = median_ms([&] { c.launch(options); }, iterations, warmup_ms);
        const double flops = 2.0 * rows_total * double(c.shape.n) * c.shape.k;
        results.push_back({preset_name, c.phase, engine_name, experts, rows, c.shape.n, c.shape.k,
                           ms, flops / ms / 1e9});
        std::printf("%-16s %-20s %-12s E %3d rows %5d n %5d k %5d  %8.3f ms  %6.1f TFLOP/s\n",
                    preset_name, c.phase, engine_name, experts, rows, c.shape.n, c.shape.k, ms,
                    results.back().tflops);
        std::fflush(stdout);
      }
    }
    MOK_CUDA_CHECK(cudaDeviceSynchronize());
  }
  if (!swiglu_cost_path.empty()) {
    std::ofstream cost_out(swiglu_cost_path);
    MOK_CHECK_ARG(cost_out.good(), "--swiglu-cost", "cannot write '", swiglu_cost_path, "'");
    cost_out << "[\n" << swiglu_cost_json << "\n]\n";
    return 0;
  }
  std::ofstream out(out_path);
  out << "[\n";
  for (size_t i = 0; i < results.size(); ++i) {
    const CaseResult& r = results[i];
    out << "  {\"preset\": \"" << r.preset << "\", \"phase\": \"" << r.phase << "\", \"engine\": \""
        << r.engine << "\", \"num_experts\": " << r.num_experts
        << ", \"rows_per_expert\": " << r.rows_per_expert << ", \"n\": " << r.n
        << ", \"k\": " << r.k << ", \"mok_ms\": " << r.ms << ", \"useful_tflops\": " << r.tflops
        << "}" << (i + 1 < results.size() ? ",\n" : "\n");
  }
  out << "]\n";
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return mok::bench::run_main("bench_gemm", [&] { return run(argc, argv); });
}
