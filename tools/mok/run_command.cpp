// mok run: one layer forward + backward on synthetic data, timed, fingerprinted and checked.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>
#include <string>
#include <thread>
#include <utility>

#include "args.hpp"
#include "commands.hpp"
#include "cpu_memory.hpp"
#include "json_output.hpp"
#include "mok/compare.hpp"
#include "mok/synthetic.hpp"
#include "progress.hpp"
#include "report.hpp"
#include "run_cuda.hpp"

namespace mok::cli {

namespace {

constexpr const char* kRunHelp = R"(usage: mok run [options]

Runs one MoE layer (shared + routed SwiGLU experts, top-k combine) on synthetic data for EP ranks,
prints the time of each phase, useful TFLOP/s, tokens/s and a checksum of every EP-invariant
output, and checks the result.

backends:
  cpu    the reference: forward and backward, EP virtual ranks one after another, in any
         --precision
  cuda   the GPU layer, one GPU per rank (EP GPUs in this process): the fused forward and the
         GPU backward. --check compares y, dx and d_topk_w on a sample of tokens covering every
         expert that received tokens with the CPU reference (the weight gradients too where the
         whole CPU backward is quick), and for EP > 1 every EP-invariant output bitwise with an
         EP=1 GPU run

options:
  --preset NAME        layer shape (default tiny; 'mok presets' lists them); the flags below
                       override its fields:
  --hidden H           hidden size (a multiple of 8)
  --intermediate I     routed experts' intermediate size (a multiple of 8)
  --shared-intermediate I_S
                       shared expert's intermediate size (a multiple of 8; 0: none)
  --experts E          routed experts (a multiple of --ep)
  --top-k K            experts per token (1 to E)
  --tokens T           tokens per rank (default: the preset's; the CPU backend refuses a run that
                       would not fit in memory and says how many fit)
  --ep R               expert-parallel ranks (default 1; must divide the number of experts)
  --backend B          auto | cpu | cuda (default auto: cuda when EP Hopper GPUs are present and
                       the layer fits them, else cpu)
  --precision P        bf16 (default), fp8 (E4M3, DeepSeek-V3 blocks of 128: H, I and I_S
                       multiples of 128) or mxfp8 (E4M3, OCP MX blocks of 32: multiples of 32).
                       On the cpu backend their --check passes an output whose error against the
                       fp64 oracle is within 5 % (+ 40 % / sqrt(tokens)) of the error the
                       quantization alone causes (the same quantized operands, everything else
                       in fp64), judged from 16 tokens on; on the cuda backend the GPU layer in
                       that mode is checked against the CPU reference's same mode on a sample of
                       tokens
  --routing R          uniform | skewed:ALPHA | single-expert (default uniform)
  --seed S             seed of the synthetic data (default 0)
  --threads N          CPU threads (default: all; results do not depend on it)
  --check              compare with the fp64 oracle (cpu) or the CPU reference on a token sample
                       (cuda) and, when R > 1, with an EP=1 run (default)
  --no-check           skip the comparison
  --low-memory-backward
                       cuda backend, bf16, EP 1: also time the low-memory GPU backward (the
                       routed experts in chunks of 1.5 T rows; MoKConfig(low_memory_backward=True)
                       in PyTorch) after the default one, print its buffers, and compare its
                       outputs with the default backward's bitwise (a difference fails the run)
  --json FILE          also write the figures as JSON (schema mok-bench/1); FILE is checked before
                       the run. '--json -' writes the JSON to standard output and everything else
                       to standard error

Numbers are plain decimal digits; an option may be given once. --help (or -h) prints this.
A CPU run longer than 2 s shows its progress on standard error (MOK_PROGRESS=always: from the
start, every update; =never: not at all).
exit code: 0 done (and PASS), 1 check FAILED, 2 bad arguments or input (one line on standard
error, starting with the option at fault) or a JSON record that could not be written.
)";

// Shape flags: each overrides one field of the preset's shape.
struct ShapeFlag {
  const char* name;
  int64_t LayerShape::*field;
  int64_t min;
};
constexpr ShapeFlag kShapeFlags[] = {
    {"hidden", &LayerShape::hidden, 1},
    {"intermediate", &LayerShape::intermediate, 1},
    {"shared-intermediate", &LayerShape::shared_intermediate, 0},
    {"experts", &LayerShape::num_experts, 1},
    {"top-k", &LayerShape::top_k, 1},
};
// Far beyond any model's layer; keeps every product of sizes well inside 64 bits.
constexpr int64_t kMaxDimension = int64_t{1} << 20;
constexpr int64_t kMaxTokensPerRank = int64_t{1} << 24;
// Of the memory the system has available, what a CPU run may plan to take.
constexpr double kUsableMemoryFraction = 0.9;

// The library's checks name fields ("top_k: ..."); on the command line the same check names the
// flag ("--top-k: ..."). Runs `step` and renames what it throws.
template <class Step>
void naming_flags(Step&& step) {
  static constexpr std::pair<const char*, const char*> kFlagOfField[] = {
      {"hidden", "--hidden"},
      {"intermediate", "--intermediate"},
      {"shared_intermediate", "--shared-intermediate"},
      {"num_experts", "--experts"},
      {"top_k", "--top-k"},
      {"ep", "--ep"},
      {"tokens", "--tokens"},
      {"preset", "--preset"},
      {"routing", "--routing"},
      {"precision", "--precision"},
  };
  try {
    step();
  } catch (const Error& error) {
    for (const auto& [field, flag] : kFlagOfField) {
      if (error.argument() != field) continue;
      const std::string message = error.what();
      throw Error(flag, message.substr(std::min(message.size(), error.argument().size() + 2)));
    }
    throw;
  }
}

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// Every option but --backend and --json into a run configuration, checked.
RunConfig read_config(const Args& args) {
  RunConfig config;
  naming_flags([&] {
    const Preset& preset = find_preset(args.text("preset", "tiny"));
    config.preset = std::string(preset.name);
    config.shape = preset.shape;
    config.tokens_per_rank = preset.default_tokens_per_rank;
  });
  for (const ShapeFlag& flag : kShapeFlags) {
    if (!args.has(flag.name)) continue;
    config.shape.*flag.field = args.integer(flag.name, 0, flag.min, kMaxDimension);
    config.shape_flags += detail::concat(config.shape_flags.empty() ? "" : " ", "--", flag.name,
                                         " ", config.shape.*flag.field);
  }
  config.tokens_per_rank = args.integer("tokens", config.tokens_per_rank, 1, kMaxTokensPerRank);
  config.ep = args.integer("ep", 1, 1, 1024);
  naming_flags([&] {
    config.shape.validate(config.ep);
    config.routing = Routing::parse(args.text("routing", "uniform"));
    config.precision = parse_precision(args.text("precision", "bf16"));
    validate_precision(config.shape, config.precision);
  });
  config.seed = static_cast<uint64_t>(args.integer("seed", 0, 0, INT64_MAX));
  config.num_threads = static_cast<int>(args.integer("threads", 0, 0, 1024));
  config.check = !args.has("no-check");
  config.low_memory_backward = args.has("low-memory-backward");
  MOK_CHECK_ARG(
      !config.low_memory_backward || (config.ep == 1 && config.precision == Precision::kBf16),
      "--low-memory-backward", "the low-memory backward runs in bf16 at EP 1; this run is ",
      precision_name(config.precision), " at EP ", config.ep);
  return config;
}

// What a CPU run will take; refuses one that would not fit in memory, naming what to change: the
// tokens when fewer fit (and how many), else the shape.
CpuMemory check_cpu_memory(const RunConfig& config, int threads, const Args& args) {
  auto need = [&](int64_t tokens_per_rank, bool check) {
    return cpu_memory(config.shape, tokens_per_rank, config.ep, check, threads, config.precision);
  };
  const CpuMemory needed = need(config.tokens_per_rank, config.check);
  const double available = available_memory_bytes();
  const double usable = kUsableMemoryFraction * available;
  if (available <= 0 || needed.peak() <= usable) return needed;  // unknown: let it try
  const std::string needs = detail::concat(
      "the CPU backend needs about ", format_bytes(needed.peak()), " (", needed.describe(), ") at ",
      config.tokens_per_rank, " tokens/rank", args.has("tokens") ? "" : " (the preset's default)",
      ", more than the ", format_bytes(usable), " usable (90 % of the ", format_bytes(available),
      " available)");
  const char* unchecked = config.check && need(config.tokens_per_rank, false).peak() <= usable
                              ? ", or --no-check (the fp64 oracle needs most of it)"
                              : "";
  // The most tokens per rank that fit; the need grows with the tokens.
  int64_t fit = 0;
  for (int64_t low = 1, high = config.tokens_per_rank - 1; low <= high;) {
    const int64_t middle = low + (high - low) / 2;
    if (need(middle, config.check).peak() <= usable) {
      fit = middle;
      low = middle + 1;
    } else {
      high = middle - 1;
    }
  }
  MOK_CHECK_ARG(fit == 0, "--tokens", needs, "; --tokens ", fit, " fits", unchecked);
  // Even one token is too many: the weights are. Name the flag that sized them, if one did.
  std::string flag = "--preset";
  for (const ShapeFlag& shape_flag : kShapeFlags) {
    if (args.has(shape_flag.name) && shape_flag.field != &LayerShape::top_k) {
      flag = std::string("--") + shape_flag.name;
      break;
    }
  }
  const bool fits_unchecked = config.check && need(1, false).peak() <= usable;
  throw Error(flag,
              detail::concat(needs, "; even 1 token/rank does not fit; ",
                             fits_unchecked ? "it does with --no-check (the fp64 oracle needs "
                                              "most of it), or with a smaller shape"
                                            : "a smaller shape does",
                             " (--preset tiny)"));
}

void print_header(const RunConfig& config, const std::string& precision) {
  std::printf("mok run: preset %s%s%s (%s), %lld tokens/rank, EP %lld, %s, routing %s, seed %llu\n",
              config.preset.c_str(), config.shape_flags.empty() ? "" : " with ",
              config.shape_flags.c_str(), config.shape.describe().c_str(),
              static_cast<long long>(config.tokens_per_rank), static_cast<long long>(config.ep),
              precision.c_str(), config.routing.name().c_str(),
              static_cast<unsigned long long>(config.seed));
}

void finish(const RunConfig& config, const RunResult& result, bool passed, JsonOutput* json) {
  if (json != nullptr) json->write(json_record(config, result));
  std::puts(!config.check ? "done (not checked)" : passed ? "PASS" : "FAIL");
}

int run_gpu(const RunConfig& config, const std::string& precision, JsonOutput* json) {
  print_header(config, precision);
  std::printf("backend: cuda (GPU layer forward and backward, one GPU per rank); GPU: %s\n",
              cuda_device_description().c_str());
  std::fflush(stdout);
  const Problem problem = Problem::generate(
      {config.shape, config.tokens_per_rank * config.ep, config.routing, config.seed});
  RunResult result;
  const bool passed = run_cuda(config, problem, result);
  finish(config, result, passed, json);
  return passed ? 0 : 1;
}

int run_cpu(const RunConfig& config, int threads, const CpuMemory& memory,
            ProgressLine::Mode progress_mode, const std::string& precision,
            const std::string& cuda_unfit, bool say_why, JsonOutput* json) {
  print_header(config, precision);
  const std::string gpus = cuda_device_description();
  // Why cuda was not picked, unless the GPU line already says it.
  say_why = say_why && cuda_unfit.find(gpus) == std::string::npos;
  std::printf("backend: cpu (reference, %d thread%s); GPU: %s%s%s\n", threads,
              threads == 1 ? "" : "s", gpus.c_str(), say_why ? "; cuda not used: " : "",
              say_why ? cuda_unfit.c_str() : "");
  std::printf("memory: at most about %s (%s)\n", format_bytes(memory.peak()).c_str(),
              memory.describe().c_str());
  std::fflush(stdout);

  const int64_t num_tokens = config.tokens_per_rank * config.ep;
  const Problem problem =
      Problem::generate({config.shape, num_tokens, config.routing, config.seed});
  ProgressLine progress_line(progress_mode);
  reference::Options options;
  options.num_threads = config.num_threads;
  options.precision = config.precision;
  options.progress = progress_line.labelled("");

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
  progress_line.clear();
  print_timings(config, result);
  std::fflush(stdout);

  bool passed = true;
  if (config.check) {
    reference::Options ep1_options = options, oracle_options = options, yardstick_options = options;
    ep1_options.progress = progress_line.labelled("check (EP 1 run)");
    oracle_options.progress = progress_line.labelled("check (fp64 oracle)");
    yardstick_options.progress = progress_line.labelled("check (quantize-then-fp64 yardstick)");
    const OracleCheck check = check_against_oracle(config, problem, result, ep1_options,
                                                   oracle_options, yardstick_options);
    progress_line.clear();
    passed = print_check(config, check);
  }
  if (const double peak = peak_resident_bytes(); peak > 0) {
    std::printf("memory: peak %s (planned at most %s)\n", format_bytes(peak).c_str(),
                format_bytes(memory.peak()).c_str());
  }
  finish(config, result, passed, json);
  return passed ? 0 : 1;
}

}  // namespace

int run_command(const std::vector<std::string>& words) {
  if (Args::wants_help(words)) {
    std::fputs(kRunHelp, stdout);
    return 0;
  }
  const Args args(words,
                  {"preset", "hidden", "intermediate", "shared-intermediate", "experts", "top-k",
                   "tokens", "ep", "backend", "precision", "routing", "seed", "threads", "json"},
                  {"check", "no-check", "low-memory-backward"});
  args.forbid_together("check", "no-check");
  RunConfig config = read_config(args);

  const std::string precision(precision_name(config.precision));
  const std::string backend = args.text("backend", "auto");
  MOK_CHECK_ARG(backend == "auto" || backend == "cpu" || backend == "cuda", "--backend",
                "unknown backend '", backend, "' (auto, cpu, cuda)");
  const ProgressLine::Mode progress_mode = ProgressLine::mode_from_environment();
  // Checked (and, for "-", standard output set aside) before any work.
  std::unique_ptr<JsonOutput> json;
  if (args.has("json")) json = std::make_unique<JsonOutput>(args.text("json", ""));

  const std::string cuda_unfit =
      backend == "cpu" ? "not asked for" : cuda_backend_unfit_reason(config);
  MOK_CHECK_ARG(backend != "cuda" || cuda_unfit.empty(), "--backend",
                "cuda cannot run here: ", cuda_unfit);
  config.backend = cuda_unfit.empty() ? "cuda" : "cpu";
  MOK_CHECK_ARG(!config.low_memory_backward || config.backend == "cuda", "--low-memory-backward",
                "the GPU backward's mode, and this run is on the cpu backend (",
                backend == "cpu" ? std::string("asked for") : cuda_unfit, ")");
  if (config.backend == "cuda") return run_gpu(config, precision, json.get());

  const int threads = config.num_threads > 0
                          ? config.num_threads
                          : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  const CpuMemory memory = check_cpu_memory(config, threads, args);
  return run_cpu(config, threads, memory, progress_mode, precision, cuda_unfit, backend == "auto",
                 json.get());
}

}  // namespace mok::cli
