// mok run: one layer forward + backward on synthetic data, timed, fingerprinted and checked.
#include <chrono>
#include <cstdio>
#include <fstream>
#include <string>
#include <thread>

#include <unistd.h>

#include "args.hpp"
#include "commands.hpp"
#include "mok/compare.hpp"
#include "mok/synthetic.hpp"
#include "report.hpp"
#include "run_cuda.hpp"

namespace mok::cli {

namespace {

constexpr const char* kRunHelp = R"(usage: mok run [options]

Runs one MoE layer (shared + routed SwiGLU experts, top-k combine) on synthetic data for EP ranks,
prints the time of each phase, useful TFLOP/s, tokens/s and a checksum of every EP-invariant
output, and checks the result.

backends:
  cpu    the reference: forward and backward, EP virtual ranks one after another
  cuda   the fused GPU layer forward, one GPU per rank (EP GPUs in this process); forward
         only (backward runs on the CPU backend). --check compares y on a sample of tokens
         covering every expert that received tokens with the CPU reference, and for EP > 1 the
         whole y bitwise with an EP=1 GPU run

options:
  --preset NAME        layer shape (default tiny; 'mok presets' lists them)
  --tokens T           tokens per rank (default: the preset's)
  --ep R               expert-parallel ranks (default 1; must divide the number of experts)
  --backend B          auto | cpu | cuda (default auto: cuda when EP Hopper GPUs are present and
                       the layer fits them, else cpu)
  --precision P        bf16 (default; fp8 and mxfp8 come later)
  --routing R          uniform | skewed:ALPHA | single-expert (default uniform)
  --seed S             seed of the synthetic data (default 0)
  --threads N          CPU threads (default: all; results do not depend on it)
  --check              compare with the fp64 oracle (cpu) or the CPU reference on a token sample
                       (cuda) and, when R > 1, with an EP=1 run (default)
  --no-check           skip the comparison
  --json FILE          also write the figures as JSON (schema mok-bench/1)

exit code: 0 done (and PASS), 1 check FAILED, 2 bad arguments or input.
)";

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// Once a run has taken 2 s, reports "  forward: routed experts  1234/5678 (21%)" on stderr:
// one line redrawn in place on a terminal, a line every 10 s elsewhere (logs).
class ProgressLine {
 public:
  void operator()(std::string_view phase, int64_t done, int64_t total) {
    const double elapsed = seconds_since(start_);
    if (elapsed < 2.0 || (!terminal_ && elapsed < last_line_ + 10.0)) return;
    last_line_ = elapsed;
    std::fprintf(stderr, "%s  %-28.*s %9lld/%-9lld (%3d%%)%s", terminal_ ? "\r" : "",
                 static_cast<int>(phase.size()), phase.data(), static_cast<long long>(done),
                 static_cast<long long>(total),
                 static_cast<int>(100 * done / std::max<int64_t>(total, 1)), terminal_ ? "" : "\n");
    shown_ = terminal_;
  }
  void finish() {
    if (shown_) std::fprintf(stderr, "\r%72s\r", "");
    shown_ = false;
  }

 private:
  std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
  bool terminal_ = isatty(fileno(stderr)) != 0;
  double last_line_ = 0;
  bool shown_ = false;
};

// Bytes the CPU backend holds: all weights (bf16), fp32 gradients, per-row intermediates, and
// with --check the fp64 oracle's copies.
double cpu_bytes_needed(const LayerShape& shape, int64_t num_tokens, bool check) {
  const double routed = static_cast<double>(shape.num_experts) * shape.intermediate * shape.hidden * 3;
  const double shared = static_cast<double>(shape.shared_intermediate) * shape.hidden * 3;
  const double rows = static_cast<double>(num_tokens) * shape.top_k;
  const double activations = rows * (shape.hidden * 8.0 + shape.intermediate * 12.0);
  return (routed + shared) * (2 + 4 + (check ? 8 : 0)) + activations * (check ? 3 : 1);
}

double available_memory_bytes() {
  std::ifstream meminfo("/proc/meminfo");
  std::string key;
  double kilobytes = 0;
  while (meminfo >> key >> kilobytes) {
    if (key == "MemAvailable:") return kilobytes * 1024.0;
    meminfo.ignore(256, '\n');
  }
  return 0;
}


void print_header(const RunConfig& config, const std::string& precision) {
  std::printf("mok run: preset %s (%s), %lld tokens/rank, EP %lld, %s, routing %s, seed %llu\n",
              config.preset.c_str(), config.shape.describe().c_str(),
              static_cast<long long>(config.tokens_per_rank), static_cast<long long>(config.ep),
              precision.c_str(), config.routing.name().c_str(),
              static_cast<unsigned long long>(config.seed));
}

int run_gpu(const RunConfig& config, const std::string& precision, const Args& args) {
  print_header(config, precision);
  std::printf("backend: cuda (fused GPU layer forward, one GPU per rank); GPU: %s\n",
              cuda_device_description().c_str());
  std::fflush(stdout);
  const Problem problem = Problem::generate(
      {config.shape, config.tokens_per_rank * config.ep, config.routing, config.seed});
  RunResult result;
  const bool passed = run_cuda(config, problem, result);
  if (args.has("json")) write_json(args.text("json", ""), config, result);
  std::puts(!config.check ? "done (not checked)" : passed ? "PASS" : "FAIL");
  return passed ? 0 : 1;
}

}  // namespace

int run_command(const std::vector<std::string>& words) {
  const Args args(words, {"preset", "tokens", "ep", "backend", "precision", "routing", "seed", "threads", "json"},
                  {"check", "no-check", "help"});
  if (args.has("help")) {
    std::fputs(kRunHelp, stdout);
    return 0;
  }
  const Preset& preset = find_preset(args.text("preset", "tiny"));
  RunConfig config;
  config.preset = std::string(preset.name);
  config.shape = preset.shape;
  config.tokens_per_rank = args.integer("tokens", preset.default_tokens_per_rank, 1, int64_t{1} << 24);
  config.ep = args.integer("ep", 1, 1, 1024);
  config.shape.validate(config.ep);
  config.routing = Routing::parse(args.text("routing", "uniform"));
  config.seed = static_cast<uint64_t>(args.integer("seed", 0, 0, INT64_MAX));
  config.num_threads = static_cast<int>(args.integer("threads", 0, 0, 1024));
  config.check = !args.has("no-check");

  const std::string precision = args.text("precision", "bf16");
  MOK_CHECK_ARG(precision == "bf16" || precision == "fp8" || precision == "mxfp8", "--precision",
                "unknown precision '", precision, "' (bf16, fp8, mxfp8)");
  MOK_CHECK_ARG(precision == "bf16", "--precision",
                precision, " is not implemented in this version; use bf16");
  const std::string backend = args.text("backend", "auto");
  MOK_CHECK_ARG(backend == "auto" || backend == "cpu" || backend == "cuda", "--backend",
                "unknown backend '", backend, "' (auto, cpu, cuda)");
  const std::string cuda_unfit = backend == "cpu" ? "not asked for" : cuda_backend_unfit_reason(config);
  MOK_CHECK_ARG(backend != "cuda" || cuda_unfit.empty(), "--backend", "cuda cannot run here: ",
                cuda_unfit);
  config.backend = cuda_unfit.empty() ? "cuda" : "cpu";
  if (config.backend == "cuda") return run_gpu(config, precision, args);

  const int64_t num_tokens = config.tokens_per_rank * config.ep;
  const double needed = cpu_bytes_needed(config.shape, num_tokens, config.check);
  const double available = available_memory_bytes();
  MOK_CHECK_ARG(available == 0 || needed < 0.8 * available, "--preset",
                "the CPU backend needs about ", static_cast<int64_t>(needed / (1 << 30)),
                " GiB for ", preset.name, " (weights and gradients of all experts), more than the ",
                static_cast<int64_t>(available / (1 << 30)), " GiB available; use --preset tiny");

  const int threads = config.num_threads > 0 ? config.num_threads
                                             : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  print_header(config, precision);
  const std::string gpus = cuda_device_description();
  // Why cuda was not picked, unless the GPU line already says it.
  const bool say_why = backend == "auto" && cuda_unfit.find(gpus) == std::string::npos;
  std::printf("backend: cpu (reference, %d threads); GPU: %s%s%s\n", threads, gpus.c_str(),
              say_why ? "; cuda not used: " : "", say_why ? cuda_unfit.c_str() : "");
  std::fflush(stdout);

  const Problem problem = Problem::generate({config.shape, num_tokens, config.routing, config.seed});
  ProgressLine progress_line;
  reference::Options options;
  options.num_threads = config.num_threads;
  options.progress = [&](std::string_view phase, int64_t done, int64_t total) {
    progress_line(phase, done, total);
  };

  RunResult result;
  result.outputs = ProblemOutputs::poisoned(problem, config.ep);
  const std::vector<reference::RankInputs> ranks = problem.all_rank_inputs(config.ep);
  const std::vector<reference::RankOutputs> outputs = result.outputs.rank_outputs(problem);
  auto start = std::chrono::steady_clock::now();
  reference::forward(config.shape, ranks, outputs, options);
  result.forward_ms = seconds_since(start) * 1e3;
  start = std::chrono::steady_clock::now();
  reference::backward(config.shape, ranks, outputs, GradMode::kOverwrite, options);
  result.backward_ms = seconds_since(start) * 1e3;
  progress_line.finish();

  print_timings(config, result);
  bool passed = true;
  if (config.check) {
    passed = check_against_oracle(config, problem, result, options);
    progress_line.finish();
  }
  if (args.has("json")) write_json(args.text("json", ""), config, result);
  std::puts(!config.check ? "done (not checked)" : passed ? "PASS" : "FAIL");
  return passed ? 0 : 1;
}

}  // namespace mok::cli
