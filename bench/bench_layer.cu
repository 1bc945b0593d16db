// The GPU layer forward (LayerForward, fused or unfused) at the benchmark presets: ms per rank
// (median of the timed iterations, slowest rank), useful TFLOP/s and tokens/s per GPU. The
// torch-native layer (bench/baselines/torch_native.py) reads the routing files this writes, so
// both run the very same routing.
//
//   bench_layer [options]   (bench_layer --help lists them)
//
// Lists of communication CTAs, minibatch rows and ring rows sweep every combination per case, one
// JSON entry each.
//
// Weights and x are seeded random values made on the device (the timing does not depend on the
// values); the routing is Problem::generate's, drawn for the case's expert count and top-k.
#include <algorithm>
#include <cstdio>
#include <ctime>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "bench_layer_args.hpp"
#include "bench_options.hpp"
#include "gpu_monitor.hpp"
#include "layer_fp8_report.hpp"
#include "mok/error.hpp"
#include "mok/layer_runner.hpp"
#include "mok/precision.hpp"
#include "mok/shape.hpp"
#include "mok/synthetic.hpp"

namespace {

using mok::bench::layer::Args;
using mok::bench::layer::BenchCase;
using mok::bench::layer::kCases;
using mok::bench::layer::parse;

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

// The sampled clock and power of one configuration's timed loops: per loop (`loops_sampled`), and
// per phase of the JSON entry (`clock_mhz`, `power_w`: fwd from the case's forward loop, fwdbwd
// and bwd from its save mode pairs, the FP8 mode's loops for an FP8 case), or why none.
void json_clocks(std::ofstream& out, const mok::bench::GpuMonitor& monitor,
                 const std::string& window_prefix, const Args& args) {
  if (!monitor.sampling()) {
    out << ", \"clock_note\": \"" << monitor.note() << "\"";
    return;
  }
  const std::string mode =
      args.fp8 ? std::string(mok::precision_name(args.fp8_precision)) + "-" : "";
  const std::map<std::string, mok::bench::GpuMonitor::Window> loops =
      monitor.windows(window_prefix);
  out << ", \"loops_sampled\": {";
  std::string line;
  for (const auto& [loop, window] : loops) {
    out << (line.empty() ? "" : ", ") << "\"" << loop << "\": {\"clock_mhz\": " << window.clock_mhz
        << ", \"power_w\": " << window.power_w << ", \"samples\": " << window.samples << "}";
    char figures[160];
    std::snprintf(figures, sizeof(figures), " %s %.0f MHz %.0f W;", loop.c_str(), window.clock_mhz,
                  window.power_w);
    line += figures;
  }
  out << "}";
  if (!line.empty())
    std::printf("    clock, power (medians over each timed loop):%s\n", line.c_str());
  const auto phase = [&](const char* key, double mok::bench::GpuMonitor::Window::*figure) {
    out << ", \"" << key << "\": {";
    bool first_phase = true;
    for (const auto& [name, loop] : {std::pair<const char*, std::string>{"fwd", mode + "fwd"},
                                     {"fwdbwd", mode + "fwdbwd"},
                                     {"bwd", mode + "fwdbwd"}}) {
      const auto window = loops.find(loop);
      if (window == loops.end()) continue;
      out << (first_phase ? "" : ", ") << "\"" << name << "\": " << window->second.*figure;
      first_phase = false;
    }
    out << "}";
  };
  phase("clock_mhz", &mok::bench::GpuMonitor::Window::clock_mhz);
  phase("power_w", &mok::bench::GpuMonitor::Window::power_w);
}

// One forward configuration of one case: runs it, prints a line, appends a JSON entry; its timed
// loops sampled by `monitor` under windows named window_prefix + loop.
void bench_one(const BenchCase& which, const mok::LayerShape& shape, const mok::Problem& routing,
               const std::string& routing_path, const Args& args, int comm_ctas, int minibatch_rows,
               int ring_rows, mok::bench::GpuMonitor& monitor, const std::string& window_prefix,
               std::ofstream& out, bool& first) {
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
  spec.warmup_ms = args.warmup_ms;
  spec.fused = args.fused;
  spec.fused_comm_ctas = comm_ctas;
  spec.fused_minibatch_rows = minibatch_rows;
  spec.fused_ring_rows = ring_rows;
  spec.fused_schedule_in_kernel = args.schedule_in_kernel;
  spec.fused_schedule_ctas = args.schedule_ctas;
  spec.fused_l2_partition_tickets = args.l2_tickets;
  spec.stale_rows = args.stale_rows;
  spec.trace = args.trace;
  spec.keep_y = false;
  spec.backward = args.backward;
  // bf16 weight gradients, as autograd gives the baseline's bf16 parameters.
  spec.bf16_gradients = true;
  spec.backward_engine = static_cast<int>(args.backward_engine);
  spec.wgrad_cluster = args.wgrad_cluster;
  spec.chunked_backward = args.chunked_backward;
  spec.fp8_forward = args.fp8;
  spec.fp8_precision = args.fp8_precision;
  spec.fp8_cluster = args.fp8_cluster;
  spec.timed_loop = [&](const std::string& loop, bool begin) {
    if (begin) {
      monitor.start(window_prefix + loop);
    } else {
      monitor.stop(window_prefix + loop);
    }
  };
  const mok::LayerRunResult result = mok::run_layer_forward(spec);
  const double flops = static_cast<double>(which.tokens_per_rank) * shape.forward_flops_per_token();
  const double tflops = flops / (result.forward_ms * 1e-3) * 1e-12;
  std::printf("%-26s %s comm %2d mb %6d ring %6d %8.3f ms/rank (ranks:", which.name.c_str(),
              !args.fused               ? "unfused"
              : args.schedule_in_kernel ? "fused"
                                        : "fused+sched",
              comm_ctas, minibatch_rows, ring_rows, result.forward_ms);
  for (double ms : result.rank_ms) std::printf(" %.3f", ms);
  std::printf(")  %7.1f useful TFLOP/s  %10.0f tokens/s/GPU  buffers %.2f GB/rank\n", tflops,
              which.tokens_per_rank / (result.forward_ms * 1e-3),
              result.buffer_bytes_per_rank / 1e9);
  if (args.backward) {
    std::printf(
        "%-26s save mode: backward %8.3f ms/rank  %7.1f useful TFLOP/s; forward + backward %8.3f "
        "ms/rank  %7.1f useful TFLOP/s  %10.0f tokens/s/GPU; backward buffers %.2f GB/rank, "
        "saved context %.3f GB/rank\n",
        "", result.backward_ms, 2 * flops / (result.backward_ms * 1e-3) * 1e-12,
        result.forward_backward_ms, 3 * flops / (result.forward_backward_ms * 1e-3) * 1e-12,
        which.tokens_per_rank / (result.forward_backward_ms * 1e-3),
        result.backward_buffer_bytes_per_rank / 1e9, result.saved_context_bytes_per_rank / 1e9);
    std::printf("%-26s recompute mode: backward %8.3f ms/rank; forward + backward %8.3f ms/rank\n",
                "", result.backward_recompute_ms, result.forward_backward_recompute_ms);
    if (result.backward_chunked_ms > 0) {
      std::printf(
          "%-26s low-memory save mode: backward %8.3f ms/rank; forward + backward %8.3f ms/rank; "
          "backward buffers %.2f GB/rank; %s save mode's bits\n",
          "", result.backward_chunked_ms, result.forward_backward_chunked_ms,
          result.backward_chunked_buffer_bytes_per_rank / 1e9,
          result.chunked_same_bits ? "the same as" : "DIFFERENT FROM");
    }
  }
  const std::string mode(mok::precision_name(args.fp8_precision));  // (with args.fp8)
  if (args.fp8) mok::bench::print_fp8_mode(result, mode, flops, args.backward);
  std::fflush(stdout);
  // An FP8 mode: the case is its forward's, the bf16 forward beside it.
  const double case_ms = args.fp8 ? result.fp8_forward_ms : result.forward_ms;
  const std::vector<double>& case_phases = args.fp8 ? result.fp8_phase_ms : result.phase_ms;
  const int64_t case_buffers =
      args.fp8 ? result.fp8_buffer_bytes_per_rank : result.buffer_bytes_per_rank;
  char line[2048];
  std::snprintf(
      line, sizeof(line),
      "%s  {\"name\": \"%s\", \"preset\": \"%s\", \"ep\": %d, \"tokens_per_rank\": %lld, "
      "\"routing\": \"%s\", \"routing_file\": \"%s\", \"mok_ms\": %.4f, "
      "\"useful_tflops\": %.2f, \"flops_per_rank\": %.6e, \"buffer_bytes_per_rank\": %lld, "
      "\"hidden\": %lld, \"intermediate\": %lld, \"shared_intermediate\": %lld, "
      "\"num_experts\": %lld, \"top_k\": %lld, \"fused\": %s, "
      "\"comm_ctas\": %d, \"minibatch_rows\": %d, \"ring_rows\": %d, "
      "\"schedule_in_kernel\": %s, \"schedule_ctas\": %d, \"l2_tickets\": %s, "
      "\"stale_rows\": %s",
      first ? "" : ",\n", which.name.c_str(), which.preset.c_str(), which.ep,
      static_cast<long long>(which.tokens_per_rank), which.routing.c_str(), routing_path.c_str(),
      case_ms, flops / (case_ms * 1e-3) * 1e-12, flops, static_cast<long long>(case_buffers),
      static_cast<long long>(shape.hidden), static_cast<long long>(shape.intermediate),
      static_cast<long long>(shape.shared_intermediate), static_cast<long long>(shape.num_experts),
      static_cast<long long>(shape.top_k), args.fused ? "true" : "false", comm_ctas, minibatch_rows,
      ring_rows, args.schedule_in_kernel ? "true" : "false", args.schedule_ctas,
      args.l2_tickets ? "true" : "false", args.stale_rows ? "true" : "false");
  out << line;
  if (args.fp8) mok::bench::json_fp8_mode(out, result, mode, args.backward);
  if (args.backward && !args.fp8) {
    out << ", \"backward_ms\": " << result.backward_ms
        << ", \"fwdbwd_ms\": " << result.forward_backward_ms
        << ", \"backward_buffer_bytes_per_rank\": " << result.backward_buffer_bytes_per_rank
        << ", \"weight_bytes_per_rank\": " << result.weight_bytes_per_rank
        << ", \"context\": \"save\", \"saved_context_bytes_per_rank\": "
        << result.saved_context_bytes_per_rank
        << ", \"backward_recompute_ms\": " << result.backward_recompute_ms
        << ", \"fwdbwd_recompute_ms\": " << result.forward_backward_recompute_ms
        << ", \"weight_gradients\": \"bf16\"";
    if (result.backward_chunked_ms > 0) {
      out << ", \"backward_chunked_ms\": " << result.backward_chunked_ms
          << ", \"fwdbwd_chunked_ms\": " << result.forward_backward_chunked_ms
          << ", \"backward_chunked_buffer_bytes_per_rank\": "
          << result.backward_chunked_buffer_bytes_per_rank
          << ", \"chunked_same_bits\": " << (result.chunked_same_bits ? "true" : "false");
    }
    const auto phases = [&](const char* key, const std::vector<double>& ms) {
      out << ", \"" << key << "\": {";
      for (size_t phase = 0; phase < ms.size(); ++phase) {
        out << (phase == 0 ? "" : ", ") << "\"" << result.backward_phase_names[phase]
            << "\": " << ms[phase];
      }
      out << "}";
    };
    phases("backward_phases_ms", result.backward_phase_ms);
    phases("backward_recompute_phases_ms", result.backward_recompute_phase_ms);
  }
  // The schedule's passes, rank 0 (LayerRunResult::schedule_pass_us).
  const auto passes = [&](const char* key, const std::vector<double>& us) {
    if (us.empty()) return;
    static const char* const kPasses[] = {"gather", "count", "scan", "place"};
    out << ", \"" << key << "\": {";
    std::printf("    %s (us, rank 0):", key);
    for (size_t pass = 0; pass < us.size() && pass < 4; ++pass) {
      out << (pass == 0 ? "" : ", ") << "\"" << kPasses[pass] << "\": " << us[pass];
      std::printf(" %s %.1f", kPasses[pass], us[pass]);
    }
    out << "}";
    std::printf("\n");
  };
  passes("schedule_passes_us", result.schedule_pass_us);
  passes("backward_schedule_passes_us", result.backward_schedule_pass_us);
  json_clocks(out, monitor, window_prefix, args);
  out << ", \"phases_ms\": {";
  for (size_t phase = 0; phase < result.phase_ms.size(); ++phase) {
    std::printf("%s%s %.3f", phase == 0 ? "    phases (ms, slowest rank): " : ", ",
                result.phase_names[phase].c_str(), result.phase_ms[phase]);
    out << (phase == 0 ? "" : ", ") << "\"" << result.phase_names[phase]
        << "\": " << case_phases[phase];
  }
  std::printf("\n");
  for (size_t phase = 0; phase < result.backward_phase_ms.size(); ++phase) {
    std::printf("%s%s %.3f",
                phase == 0 ? "    backward phases, save mode (ms, slowest rank): " : ", ",
                result.backward_phase_names[phase].c_str(), result.backward_phase_ms[phase]);
  }
  if (!result.backward_phase_ms.empty()) std::printf("\n");
  for (size_t phase = 0; phase < result.backward_recompute_phase_ms.size(); ++phase) {
    std::printf("%s%s %.3f", phase == 0 ? "    backward phases, recompute mode: " : ", ",
                result.backward_phase_names[phase].c_str(),
                result.backward_recompute_phase_ms[phase]);
  }
  if (!result.backward_recompute_phase_ms.empty()) std::printf("\n");
  for (const std::string& line : result.trace_summary) std::printf("    trace %s\n", line.c_str());
  std::fflush(stdout);
  out << "}}";
  out.flush();
  first = false;
  MOK_CHECK_ARG(result.backward_chunked_ms == 0 || result.chunked_same_bits, "--chunked-backward",
                "the low-memory backward's outputs differ from save mode's");
}

}  // namespace

int run(int argc, char** argv) {
  Args args;
  if (!parse(argc, argv, args)) return 0;
  if (args.iters < 1) throw mok::bench::UsageError("--iters", "must be >= 1");
  if (args.warmup_ms < 0) throw mok::bench::UsageError("--warmup-ms", "must be >= 0");
  std::ofstream out(args.out);
  MOK_CHECK_ARG(out.good(), "--out", "cannot write '", args.out, "'");
  char date[32];
  const std::time_t now = std::time(nullptr);
  std::strftime(date, sizeof(date), "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
  out << "{\"date\": \"" << date << "\", \"cases\": [\n";
  bool first = true, failed = false;
  std::unique_ptr<mok::bench::GpuMonitor> monitor;  // made for the first case that runs
  int configurations = 0;
  if (args.custom && !args.cases.empty()) {
    throw mok::bench::UsageError("--cases",
                                 "cannot be combined with a custom shape (--hidden ...)");
  }
  const std::vector<BenchCase> cases =
      args.custom ? std::vector<BenchCase>{args.custom_case} : kCases;
  for (const BenchCase& which : cases) {
    if (!args.cases.empty() &&
        std::find(args.cases.begin(), args.cases.end(), which.name) == args.cases.end()) {
      continue;
    }
    const mok::LayerShape shape =
        args.custom ? args.custom_shape : mok::find_preset(which.preset).shape;
    shape.validate(which.ep);
    const std::string unfit = mok::gpu_layer_unfit_reason(
        shape, which.ep, which.tokens_per_rank, args.backward, args.fp8, args.fp8_precision);
    if (!unfit.empty()) {
      std::printf("%-26s skipped: %s\n", which.name.c_str(), unfit.c_str());
      continue;
    }
    try {
      if (!monitor) monitor = std::make_unique<mok::bench::GpuMonitor>(0);
      const mok::Problem routing = routing_of(which, shape);
      std::string routing_path;
      if (!args.routing_dir.empty()) {
        routing_path = args.routing_dir + "/" + which.name + ".bin";
        write_routing(routing_path, routing);
      }
      for (const int comm_ctas : args.comm_ctas) {
        for (const int minibatch_rows : args.minibatch_rows) {
          for (const int ring_rows : args.ring_rows) {
            const std::string window_prefix = std::to_string(configurations++) + "/";
            bench_one(which, shape, routing, routing_path, args, comm_ctas, minibatch_rows,
                      ring_rows, *monitor, window_prefix, out, first);
          }
        }
      }
    } catch (const std::exception& error) {
      // A failed case (e.g. a device timeout) is reported; the next case makes a new layer.
      std::printf("%-26s FAILED: %s\n", which.name.c_str(), error.what());
      std::fflush(stdout);
      failed = true;
    }
  }
  out << "\n]}\n";
  return failed ? 1 : 0;
}

int main(int argc, char** argv) {
  return mok::bench::run_main("bench_layer", [&] { return run(argc, argv); });
}
