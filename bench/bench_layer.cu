// The unfused GPU layer forward (LayerForward) at the benchmark presets: ms per rank (median of
// the timed iterations, slowest rank), useful TFLOP/s and tokens/s per GPU. The torch-native
// layer (bench/baselines/torch_native.py) reads the routing files this writes, so both run the
// very same routing.
//
//   bench_layer [--cases NAME,...] [--iters 20] [--out layer-mok.json] [--routing-dir DIR]
//               [--gemm-sms N] [--copy-ctas N]
//
// Weights and x are seeded random values made on the device (the timing does not depend on the
// values); the routing is Problem::generate's, drawn for the case's expert count and top-k.
#include <algorithm>
#include <cstdio>
#include <ctime>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "mok/error.hpp"
#include "mok/shape.hpp"
#include "mok/synthetic.hpp"
#include "runtime/layer_runner.hpp"

namespace {

struct BenchCase {
  std::string name, preset, routing;
  int ep;
  int64_t tokens_per_rank;
};

const std::vector<BenchCase> kCases = {
    {"deepseek-v3-ep1", "deepseek-v3", "uniform", 1, 8192},
    {"deepseek-v3-ep2", "deepseek-v3", "uniform", 2, 8192},
    {"qwen3-30b-a3b-ep2", "qwen3-30b-a3b", "uniform", 2, 16384},
    {"qwen3-235b-a22b-ep2", "qwen3-235b-a22b", "uniform", 2, 8192},
    {"deepseek-v3-ep2-skewed", "deepseek-v3", "skewed:0.8", 2, 8192},
};

struct Args {
  std::vector<std::string> cases;
  int iters = 20;
  int gemm_sms = 0, copy_ctas = 0;
  std::string out = "layer-mok.json", routing_dir;
};

Args parse(int argc, char** argv) {
  Args args;
  for (int index = 1; index + 1 < argc; index += 2) {
    const std::string key = argv[index], value = argv[index + 1];
    if (key == "--cases") {
      std::stringstream stream(value);
      for (std::string part; std::getline(stream, part, ',');) args.cases.push_back(part);
    } else if (key == "--iters") args.iters = std::stoi(value);
    else if (key == "--gemm-sms") args.gemm_sms = std::stoi(value);
    else if (key == "--copy-ctas") args.copy_ctas = std::stoi(value);
    else if (key == "--out") args.out = value;
    else if (key == "--routing-dir") args.routing_dir = value;
    else throw mok::Error("arguments", "unknown option " + key);
  }
  return args;
}

// Routing only: Problem::generate on a layer of the case's E and k with minimal H and I (its
// routing stream does not depend on H or I).
mok::Problem routing_of(const BenchCase& which, const mok::LayerShape& shape) {
  mok::SyntheticSpec spec;
  spec.shape = {8, 8, 0, shape.num_experts, shape.top_k};
  spec.num_tokens = which.tokens_per_rank * which.ep;
  spec.routing = mok::Routing::parse(which.routing);
  spec.seed = 1;
  return mok::Problem::generate(spec);
}

// (T_global, k) int32 ids then (T_global, k) fp32 weights, raw little-endian.
void write_routing(const std::string& path, const mok::Problem& routing) {
  std::ofstream file(path, std::ios::binary);
  MOK_CHECK_ARG(file.good(), "--routing-dir", "cannot write '", path, "'");
  file.write(reinterpret_cast<const char*>(routing.topk_idx.data()),
             static_cast<std::streamsize>(routing.topk_idx.size() * sizeof(int32_t)));
  file.write(reinterpret_cast<const char*>(routing.topk_w.data()),
             static_cast<std::streamsize>(routing.topk_w.size() * sizeof(float)));
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const Args args = parse(argc, argv);
    std::ofstream out(args.out);
    MOK_CHECK_ARG(out.good(), "--out", "cannot write '", args.out, "'");
    char date[32];
    const std::time_t now = std::time(nullptr);
    std::strftime(date, sizeof(date), "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
    out << "{\"date\": \"" << date << "\", \"cases\": [\n";
    bool first = true, failed = false;
    for (const BenchCase& which : kCases) {
      if (!args.cases.empty() &&
          std::find(args.cases.begin(), args.cases.end(), which.name) == args.cases.end()) {
        continue;
      }
      const mok::LayerShape shape = mok::find_preset(which.preset).shape;
      const std::string unfit = mok::gpu_layer_unfit_reason(shape, which.ep, which.tokens_per_rank);
      if (!unfit.empty()) {
        std::printf("%-26s skipped: %s\n", which.name.c_str(), unfit.c_str());
        continue;
      }
      try {
        const mok::Problem routing = routing_of(which, shape);
        std::string routing_path;
        if (!args.routing_dir.empty()) {
          routing_path = args.routing_dir + "/" + which.name + ".bin";
          write_routing(routing_path, routing);
        }
        mok::LayerRunSpec spec;
        spec.shape = shape;
        spec.ep = which.ep;
        spec.tokens_per_rank = which.tokens_per_rank;
        spec.topk_idx = &routing.topk_idx;
        spec.topk_w = &routing.topk_w;
        spec.seed = 7;
        spec.gemm_sms = args.gemm_sms;
        spec.copy_ctas = args.copy_ctas;
        spec.iterations = args.iters;
        spec.keep_y = false;
        const mok::LayerRunResult result = mok::run_layer_forward(spec);
        const double flops = static_cast<double>(which.tokens_per_rank) * shape.forward_flops_per_token();
        const double tflops = flops / (result.forward_ms * 1e-3) * 1e-12;
        std::printf("%-26s %8.3f ms/rank (ranks:", which.name.c_str(), result.forward_ms);
        for (double ms : result.rank_ms) std::printf(" %.3f", ms);
        std::printf(")  %7.1f useful TFLOP/s  %10.0f tokens/s/GPU  buffers %.2f GB/rank\n", tflops,
                    which.tokens_per_rank / (result.forward_ms * 1e-3),
                    result.buffer_bytes_per_rank / 1e9);
        std::fflush(stdout);
        char line[1024];
        std::snprintf(line, sizeof(line),
                      "%s  {\"name\": \"%s\", \"preset\": \"%s\", \"ep\": %d, \"tokens_per_rank\": %lld, "
                      "\"routing\": \"%s\", \"routing_file\": \"%s\", \"mok_ms\": %.4f, "
                      "\"useful_tflops\": %.2f, \"flops_per_rank\": %.6e, \"buffer_bytes_per_rank\": %lld, "
                      "\"hidden\": %lld, \"intermediate\": %lld, \"shared_intermediate\": %lld, "
                      "\"num_experts\": %lld, \"top_k\": %lld",
                      first ? "" : ",\n", which.name.c_str(), which.preset.c_str(), which.ep,
                      static_cast<long long>(which.tokens_per_rank), which.routing.c_str(),
                      routing_path.c_str(), result.forward_ms, tflops, flops,
                      static_cast<long long>(result.buffer_bytes_per_rank),
                      static_cast<long long>(shape.hidden), static_cast<long long>(shape.intermediate),
                      static_cast<long long>(shape.shared_intermediate),
                      static_cast<long long>(shape.num_experts), static_cast<long long>(shape.top_k));
        out << line;
        out << ", \"phases_ms\": {";
        for (size_t phase = 0; phase < result.phase_ms.size(); ++phase) {
          std::printf("%s%s %.3f", phase == 0 ? "    phases (ms, slowest rank): " : ", ",
                      result.phase_names[phase].c_str(), result.phase_ms[phase]);
          out << (phase == 0 ? "" : ", ") << "\"" << result.phase_names[phase]
              << "\": " << result.phase_ms[phase];
        }
        std::printf("\n");
        std::fflush(stdout);
        out << "}}";
        out.flush();
        first = false;
      } catch (const std::exception& error) {
        // A failed case (e.g. a device timeout) is reported; the next case makes a new layer.
        std::printf("%-26s FAILED: %s\n", which.name.c_str(), error.what());
        std::fflush(stdout);
        failed = true;
      }
    }
    out << "\n]}\n";
    return failed ? 1 : 0;
  } catch (const std::exception& error) {
    std::fprintf(stderr, "bench_layer: error: %s\n", error.what());
    return 1;
  }
}
