// bench_layer's cases and command line: the benchmark presets it runs, its options and their
// parsing (bench_options.hpp's `--name value` pairs), for bench_layer.cu.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "bench_options.hpp"
#include "mok/gemm.hpp"
#include "mok/precision.hpp"
#include "mok/shape.hpp"
#include "mok/synthetic.hpp"

namespace mok::bench::layer {

struct BenchCase {
  std::string name, preset, routing;
  int ep;
  int64_t tokens_per_rank;
};

inline const std::vector<BenchCase> kCases = {
    {"deepseek-v3-ep1", "deepseek-v3", "uniform", 1, 8192},
    {"qwen3-30b-a3b-ep1", "qwen3-30b-a3b", "uniform", 1, 16384},
    {"qwen3-235b-a22b-ep1", "qwen3-235b-a22b", "uniform", 1, 8192},
    {"mixtral-8x7b-ep1", "mixtral-8x7b", "uniform", 1, 8192},
    {"deepseek-v3-ep2", "deepseek-v3", "uniform", 2, 8192},
    {"qwen3-30b-a3b-ep2", "qwen3-30b-a3b", "uniform", 2, 16384},
    {"qwen3-235b-a22b-ep2", "qwen3-235b-a22b", "uniform", 2, 8192},
    {"deepseek-v3-ep2-skewed", "deepseek-v3", "skewed:0.8", 2, 8192},
};

struct Args {
  std::vector<std::string> cases;
  int iters = 20, warmup_ms = 500;
  int gemm_sms = 0, copy_ctas = 0, schedule_ctas = 0;
  bool fused = true, schedule_in_kernel = true, l2_tickets = true, trace = false, stale_rows = true;
  std::vector<int> comm_ctas{0}, minibatch_rows{0}, ring_rows{0};
  std::string out = "layer-mok.json", routing_dir;
  bool backward = true;
  bool fp8 = false;  // --precision fp8 or mxfp8: an FP8 mode, run beside bf16
  mok::Precision fp8_precision = mok::Precision::kFp8;  // which one
  int fp8_cluster = 0;
  mok::gemm::GemmEngine backward_engine = mok::gemm::GemmEngine::kAuto;
  int wgrad_cluster = 0;
  bool chunked_backward = false;
  // A case of any shape (--hidden and the rest): the preset's values where a flag is not given.
  bool custom = false;
  BenchCase custom_case{"custom", "deepseek-v3", "uniform", 1, 8192};
  mok::LayerShape custom_shape = mok::find_preset("deepseek-v3").shape;
};

inline constexpr char kUsage[] =
    R"(bench_layer: the GPU layer forward (fused kernel by default) at the benchmark presets, ms per
rank (median, slowest rank), useful TFLOP/s and tokens/s per GPU; EP 2 cases need two Hopper GPUs.

usage: bench_layer [options]

  --cases NAME,...          deepseek-v3-ep1, qwen3-30b-a3b-ep1, qwen3-235b-a22b-ep1,
                            mixtral-8x7b-ep1, deepseek-v3-ep2, qwen3-30b-a3b-ep2,
                            qwen3-235b-a22b-ep2, deepseek-v3-ep2-skewed (default all)
  --backward 0|1            1: also the GPU backward, timed alone and as forward + backward
                            pairs, in recompute mode and in save mode (the forward keeps its
                            context) (default 1)
  --chunked-backward 0|1    1: with --backward 1, at EP 1, save mode again with the low-memory
                            backward (the routed experts in chunks of 1.5 T rows), its outputs
                            checked bitwise against save mode's; the JSON's cases then carry
                            backward_chunked_ms, fwdbwd_chunked_ms,
                            backward_chunked_buffer_bytes_per_rank and chunked_same_bits
                            (default 0)
  --precision bf16|fp8|mxfp8
                            fp8 or mxfp8: after the bf16 forward, the forward in that FP8 mode
                            (fp8: the DeepSeek-V3 recipe, not yet fused; mxfp8: OCP MX blocks of
                            32, a numerics mode on the bf16 engine) on the same inputs and
                            weights, timed alike, and with --backward 1 its training step
                            (weights quantized + forward + backward) in save mode and recompute
                            mode, and the save mode step on the cached weights (a
                            gradient-accumulation step: forward + backward); the JSON's cases
                            then carry the mode's figures (mok_ms, backward_ms, fwdbwd_ms,
                            fwdbwd_cached_weights_ms, and *_recompute_ms; the weight cache's
                            bytes as fp8_weight_bytes_per_rank) with "precision": "fp8" or
                            "mxfp8" and the bf16 ones as bf16_forward_ms, bf16_backward_ms,
                            bf16_fwdbwd_ms (default bf16)
  --fp8-cluster N           CTAs per cluster of the fp8 forward's GEMMs: 1 or 2 (same bits;
                            default 1)
  --backward-engine E       the backward's GEMM engine: auto, cooperative or pingpong (same
                            bits; default auto)
  --wgrad-cluster N         CTAs per cluster of the backward's weight-gradient GEMMs: 1 or 2
                            (same bits; default 2)
  --preset NAME, --hidden H, --intermediate I, --shared-intermediate I_S, --experts E,
  --top-k K, --tokens T, --ep R, --routing uniform|skewed:ALPHA|single-expert
                            one case of any shape instead (named "custom"): the preset's values
                            (default deepseek-v3, 8192 tokens per rank, EP 1) where a flag is
                            not given
  --iters N                 timed forwards per configuration (default 20)
  --warmup-ms MS            untimed forwards for MS ms first (at least 3), so that the timed
                            ones run at the clock the forward's own power draw sets under the
                            power cap, not the idle GPU's (default 500)
  --out FILE                results JSON (default layer-mok.json)
  --routing-dir DIR         also write each case's routing there, for the torch-native baseline
  --fused 0|1               0: the unfused composition instead of the fused kernel (default 1)
  --schedule-in-kernel 0|1  0: the schedule's own kernels before the fused kernel (default 1)
  --comm-ctas N,...         communication CTAs to sweep (0, the default: none, three spare
                            warps of every CTA dispatch beside its tiles)
  --minibatch-rows N,...    minibatch rows to sweep (0 = default)
  --ring-rows N,...         ring rows to sweep (0 = a ring for every row, one round)
  --schedule-ctas N         CTAs that make the schedule in the kernel (0 = every CTA)
  --l2-tickets 0|1          0: the fused kernel's tasks from one pool, not a grant per L2
                            partition of the GPU (default 1)
  --stale-rows 0|1          1: before the warm-up, one forward with another routing, so that
                            the padding rows the MMAs multiply hold rows, as in training;
                            0: a fresh allocation's zeros, ~0.5-1 % faster (default 1)
  --gemm-sms N              SMs of the unfused path's GEMMs (0 = all)
  --copy-ctas N             CTAs of the unfused path's copies (0 = default)
  --trace 0|1               1: one more forward with the fused kernel's per-CTA timeline
)";

inline int integer(const std::string& name, const std::string& value) {
  return static_cast<int>(mok::bench::integer_option(name, value));
}

// Returns false when --help was asked for.
inline bool parse(int argc, char** argv, Args& args) {
  return mok::bench::parse_options(
      argc, argv, kUsage, [&](const std::string& key, const std::string& value) {
        if (key == "--cases") {
          args.cases = mok::bench::list_option(key, value);
          for (const std::string& name : args.cases) {
            const bool known =
                std::any_of(kCases.begin(), kCases.end(),
                            [&](const BenchCase& which) { return which.name == name; });
            if (!known) throw mok::bench::UsageError(key, "no case is called '" + name + "'");
          }
        } else if (key == "--iters")
          args.iters = integer(key, value);
        else if (key == "--backward")
          args.backward = integer(key, value) != 0;
        else if (key == "--chunked-backward")
          args.chunked_backward = integer(key, value) != 0;
        else if (key == "--backward-engine") {
          if (value == "auto")
            args.backward_engine = mok::gemm::GemmEngine::kAuto;
          else if (value == "cooperative")
            args.backward_engine = mok::gemm::GemmEngine::kCooperative;
          else if (value == "pingpong")
            args.backward_engine = mok::gemm::GemmEngine::kPingpong;
          else
            throw mok::bench::UsageError(
                key, "expected auto, cooperative or pingpong, got '" + value + "'");
        } else if (key == "--precision") {
          if (value != "bf16" && value != "fp8" && value != "mxfp8")
            throw mok::bench::UsageError(key, "expected bf16, fp8 or mxfp8, got '" + value + "'");
          args.fp8 = value != "bf16";
          if (args.fp8) args.fp8_precision = mok::parse_precision(value);
        } else if (key == "--fp8-cluster") {
          args.fp8_cluster = integer(key, value);
          if (args.fp8_cluster != 1 && args.fp8_cluster != 2)
            throw mok::bench::UsageError(key, "expected 1 or 2, got '" + value + "'");
        } else if (key == "--wgrad-cluster") {
          args.wgrad_cluster = integer(key, value);
          if (args.wgrad_cluster != 1 && args.wgrad_cluster != 2)
            throw mok::bench::UsageError(key, "expected 1 or 2, got '" + value + "'");
        } else if (key == "--preset") {
          args.custom = true;
          args.custom_case.preset = value;
          args.custom_shape = mok::find_preset(value).shape;
        } else if (key == "--hidden")
          args.custom = true, args.custom_shape.hidden = integer(key, value);
        else if (key == "--intermediate") {
          args.custom = true;
          args.custom_shape.intermediate = integer(key, value);
        } else if (key == "--shared-intermediate") {
          args.custom = true;
          args.custom_shape.shared_intermediate = integer(key, value);
        } else if (key == "--experts") {
          args.custom = true;
          args.custom_shape.num_experts = integer(key, value);
        } else if (key == "--top-k")
          args.custom = true, args.custom_shape.top_k = integer(key, value);
        else if (key == "--tokens") {
          args.custom = true;
          args.custom_case.tokens_per_rank = integer(key, value);
        } else if (key == "--ep")
          args.custom = true, args.custom_case.ep = integer(key, value);
        else if (key == "--routing") {
          args.custom = true;
          mok::Routing::parse(value);  // checked here, named by the error
          args.custom_case.routing = value;
        } else if (key == "--warmup-ms")
          args.warmup_ms = integer(key, value);
        else if (key == "--gemm-sms")
          args.gemm_sms = integer(key, value);
        else if (key == "--copy-ctas")
          args.copy_ctas = integer(key, value);
        else if (key == "--schedule-ctas")
          args.schedule_ctas = integer(key, value);
        else if (key == "--fused")
          args.fused = integer(key, value) != 0;
        else if (key == "--schedule-in-kernel")
          args.schedule_in_kernel = integer(key, value) != 0;
        else if (key == "--trace")
          args.trace = integer(key, value) != 0;
        else if (key == "--l2-tickets")
          args.l2_tickets = integer(key, value) != 0;
        else if (key == "--stale-rows")
          args.stale_rows = integer(key, value) != 0;
        else if (key == "--comm-ctas")
          args.comm_ctas = mok::bench::integer_list_option(key, value);
        else if (key == "--minibatch-rows")
          args.minibatch_rows = mok::bench::integer_list_option(key, value);
        else if (key == "--ring-rows")
          args.ring_rows = mok::bench::integer_list_option(key, value);
        else if (key == "--out")
          args.out = value;
        else if (key == "--routing-dir")
          args.routing_dir = value;
        else
          return false;
        return true;
      });
}

}  // namespace mok::bench::layer
