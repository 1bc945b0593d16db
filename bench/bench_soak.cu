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
#include <cuda_runtime.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <memory>
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
#include "soak.cuh"

namespace {

using mok::bench::UsageError;
using mok::detail::concat;
using namespace mok::soak;

// ---- command line ---------------------------------------------------------------------------

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
