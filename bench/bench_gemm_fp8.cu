// Benchmark of the FP8 blockwise-scaled grouped GEMMs (mok/gemm_fp8.hpp) at one rank of EP2 with
// balanced routing (2 ranks x 8192 tokens x top-8 = 65,536 rows over the rank's experts):
// deepseek-v3 gate/up (128 experts x 512 rows, 7168 -> 4096), plain and SwiGLU-fused, and down
// (2048 -> 7168), forward, dgrad and wgrad, beside the bf16 engine on the same values (same
// device run, same clocks). Operands are random bf16 quantized on the GPU by mok's own quantizers
// (1 x 128 activations and gradients, 128 x 128 weights and transposed weights, 1 x 128 on the
// transposed copies for the wgrad). Median of timed iterations with CUDA events after warm-up.
// Writes one JSON object per case to --out; bench/baselines/torch_scaled_grouped_mm.py times
// torch's rowwise FP8 grouped GEMM on the same shapes.
//
//   bench_gemm_fp8 [--out FILE] [--iterations N] [--warmup-ms MS] [--only PHASE]
//                  [--variants LIST] [--rounds N]
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "bench_device.cuh"
#include "bench_options.hpp"
#include "mok/cuda_check.hpp"
#include "mok/gemm.hpp"
#include "mok/gemm_fp8.hpp"
#include "mok/gpu.hpp"
#include "mok/quantize.hpp"
#include "mok/shape.hpp"

namespace {

using namespace mok::gemm;

using Buffer = mok::bench::DeviceBytes;
using mok::bench::fill_random;

// An operand in bf16 and its FP8 quantization (data, fp32 scales) by mok's quantizer.
struct Operand {
  mok::quantize::Layout layout;
  Buffer values, data, scales;
  Operand(const mok::quantize::Layout& l, uint32_t seed, float scale)
      : layout(l), values(l.num_elements() * 2), data(l.num_elements()), scales(l.scale_bytes()) {
    fill_random<<<1024, 256>>>(values.as<__nv_bfloat16>(), l.num_elements(), seed, scale);
    MOK_CUDA_CHECK_LAUNCH();
    mok::quantize::quantize_gpu(layout, values.data, mok::quantize::InputType::kBf16,
                                data.as<uint8_t>(), scales.data, nullptr);
  }
};

using mok::bench::median_ms;

constexpr const char* kPhases[] = {"gemm-gateup",
                                   "gemm-gateup-swiglu",
                                   "gemm-down",
                                   "gemm-gateup-dgrad",
                                   "gemm-down-dgrad",
                                   "gemm-gateup-wgrad",
                                   "gemm-gateup-wgrad-accumulate",
                                   "gemm-down-wgrad",
                                   "gemm-down-wgrad-accumulate"};

constexpr char kUsage[] =
    R"(bench_gemm_fp8: the FP8 blockwise-scaled grouped GEMM (DeepSeek-V3 recipe) at deepseek-v3,
one rank of EP N with balanced routing (65,536 rows over 256 / N experts), beside the bf16
engine on the same values; one Hopper GPU.

usage: bench_gemm_fp8 [--out FILE] [--iterations N] [--warmup-ms MS] [--only PHASE]
                      [--variants LIST] [--rounds N] [--ep N] [--jitter R]

  --out FILE       results, one JSON object per case and precision (default gemm-fp8-mok.json)
  --iterations N   timed iterations per case, median reported (default 20)
  --warmup-ms MS   untimed launches of each case for MS ms first (default 300)
  --only PHASE     one phase: gemm-gateup (7168 -> 4096), gemm-gateup-swiglu (the same with
                   SwiGLU fused, output 2048 wide), gemm-down (2048 -> 7168); their backward:
                   gemm-gateup-dgrad, gemm-down-dgrad (bf16 dx), gemm-gateup-wgrad,
                   gemm-down-wgrad (bf16 dW) and gemm-gateup-wgrad-accumulate,
                   gemm-down-wgrad-accumulate (fp32 main_grad += dW)
  --variants LIST  forward kernel pipelines (mok::gemm::Fp8Pipeline) timed side by side on the
                   forward and dgrad phases, comma-separated cCsS (C CTAs per cluster, S stages,
                   0 = the default), e.g. c1s3,c2s4 (default c0s0)
  --rounds N       time every case N times in turn, variants alternating (default 1)
  --ep N           the EP degree whose one rank is timed: 1, 2, 4 or 8 (default 2; 256, 512,
                   1024 or 2048 rows an expert)
  --jitter R       experts of R rows more and R rows fewer in turn, each starting on a
                   128-row boundary, as the layer lays out its experts (a short last block
                   in most tiles); 0 < R < the rows an expert (default 0: every expert the
                   same rows, packed)
)";

// "cCsS" -> the pipeline it names.
Fp8Pipeline parse_variant(const std::string& text) {
  Fp8Pipeline pipeline;
  char tail = 0;
  if (std::sscanf(text.c_str(), "c%ds%d%c", &pipeline.cluster, &pipeline.stages, &tail) != 2) {
    throw mok::bench::UsageError("--variants", "'" + text + "' is not of the form cCsS");
  }
  return pipeline;
}

struct CaseResult {
  std::string phase, precision, variant;
  int round, n, k;
  double ms, tflops;
};

int run(int argc, char** argv) {
  std::string out_path = "gemm-fp8-mok.json", only;
  int iterations = 20, rounds = 1, ep = 2, jitter = 0;
  double warmup_ms = 300;
  std::vector<std::string> variants;
  const bool go = mok::bench::parse_options(
      argc, argv, kUsage, [&](const std::string& name, const std::string& value) {
        if (name == "--out")
          out_path = value;
        else if (name == "--iterations")
          iterations = static_cast<int>(mok::bench::integer_option(name, value));
        else if (name == "--warmup-ms")
          warmup_ms = static_cast<double>(mok::bench::integer_option(name, value));
        else if (name == "--only")
          only = value;
        else if (name == "--rounds")
          rounds = static_cast<int>(mok::bench::integer_option(name, value));
        else if (name == "--ep")
          ep = static_cast<int>(mok::bench::integer_option(name, value));
        else if (name == "--jitter")
          jitter = static_cast<int>(mok::bench::integer_option(name, value));
        else if (name == "--variants") {
          variants.clear();
          for (size_t begin = 0; begin <= value.size();) {
            const size_t end = std::min(value.find(',', begin), value.size());
            variants.push_back(value.substr(begin, end - begin));
            begin = end + 1;
          }
        } else
          return false;
        return true;
      });
  if (!go) return 0;
  if (iterations < 1) throw mok::bench::UsageError("--iterations", "must be >= 1");
  if (rounds < 1) throw mok::bench::UsageError("--rounds", "must be >= 1");
  if (ep != 1 && ep != 2 && ep != 4 && ep != 8)
    throw mok::bench::UsageError("--ep", "must be 1, 2, 4 or 8");
  if (variants.empty()) variants.push_back("c0s0");
  std::vector<Fp8Pipeline> pipelines;
  for (const std::string& variant : variants) pipelines.push_back(parse_variant(variant));
  if (warmup_ms < 0) throw mok::bench::UsageError("--warmup-ms", "must be >= 0");
  if (!only.empty() && std::find_if(std::begin(kPhases), std::end(kPhases), [&](const char* p) {
                         return only == p;
                       }) == std::end(kPhases)) {
    throw mok::bench::UsageError("--only", "no phase is called '" + only + "'");
  }
  constexpr int kTokensPerRank = 8192;
  const mok::LayerShape& layer = mok::find_preset("deepseek-v3").shape;
  const int experts = static_cast<int>(layer.num_experts) / ep;
  const int rows = static_cast<int>(kTokensPerRank * layer.top_k) / experts;
  if (jitter < 0 || jitter >= rows) {
    throw mok::bench::UsageError("--jitter", "must be >= 0 and below " + std::to_string(rows));
  }
  const mok::GpuSummary gpus = mok::query_gpus();
  if (gpus.num_hopper_gpus < 1)
    throw mok::Error("", "needs a Hopper GPU; found " + gpus.description);

  const int hidden = static_cast<int>(layer.hidden), inter = static_cast<int>(layer.intermediate);
  // Expert e's rows (counts) from offsets[e]; with jitter, each expert's span rounded up to 128
  // rows (the rest padding, which no tile reads into a result). rows_total: the real rows.
  std::vector<int> offsets(experts + 1, 0), counts(experts);
  int rows_total = 0;
  for (int e = 0; e < experts; ++e) {
    counts[e] = rows + (e % 2 == 0 ? jitter : -jitter);
    rows_total += counts[e];
    offsets[e + 1] = offsets[e] + (jitter > 0 ? (counts[e] + 127) / 128 * 128 : counts[e]);
  }
  const int capacity = offsets[experts];
  Buffer offsets_device(offsets.size() * sizeof(int)), counts_device(counts.size() * sizeof(int));
  MOK_CUDA_CHECK(cudaMemcpy(offsets_device.data, offsets.data(), offsets.size() * sizeof(int),
                            cudaMemcpyHostToDevice));
  MOK_CUDA_CHECK(cudaMemcpy(counts_device.data, counts.data(), counts.size() * sizeof(int),
                            cudaMemcpyHostToDevice));
  const int* offs = offsets_device.as<int>();
  using mok::quantize::describe;
  using mok::quantize::Format;
  const Operand x(describe(Format::kFp8, 1, capacity, hidden, 1, 128, false), 1, 1.0f);
  const Operand w_gate_up(describe(Format::kFp8, experts, 2 * inter, hidden, 128, 128, false), 2,
                          0.05f);
  const Operand h(describe(Format::kFp8, 1, capacity, inter, 1, 128, false), 4, 1.0f);
  const Operand w_down(describe(Format::kFp8, experts, hidden, inter, 128, 128, false), 3, 0.05f);
  // Backward operands: the gradients 1 x 128 along their features (dgrad) and on their
  // transposed copies (wgrad), the weights transposed (E, k, n) per 128 x 128 block.
  const Operand d_gate_up(describe(Format::kFp8, 1, capacity, 2 * inter, 1, 128, false), 5, 1.0f);
  const Operand dy(describe(Format::kFp8, 1, capacity, hidden, 1, 128, false), 6, 1.0f);
  const Operand w_gate_up_t(describe(Format::kFp8, experts, hidden, 2 * inter, 128, 128, false), 7,
                            0.05f);
  const Operand w_down_t(describe(Format::kFp8, experts, inter, hidden, 128, 128, false), 8, 0.05f);
  const Operand d_gate_up_t(describe(Format::kFp8, 1, capacity, 2 * inter, 1, 128, true), 9, 1.0f);
  const Operand x_t(describe(Format::kFp8, 1, capacity, hidden, 1, 128, true), 10, 1.0f);
  const Operand dy_t(describe(Format::kFp8, 1, capacity, hidden, 1, 128, true), 11, 1.0f);
  const Operand h_t(describe(Format::kFp8, 1, capacity, inter, 1, 128, true), 12, 1.0f);
  const size_t out_bytes = std::max(static_cast<size_t>(capacity) * std::max(2 * inter, hidden) * 2,
                                    static_cast<size_t>(experts) * 2 * inter * hidden * 4);
  Buffer out(out_bytes);
  void* const out_data = out.data;
  MOK_CUDA_CHECK(cudaDeviceSynchronize());

  GroupedShape gate_up{experts, capacity, 2 * inter, hidden};
  GroupedShape down{experts, capacity, hidden, inter};
  if (jitter > 0) gate_up.expert_counts = down.expert_counts = counts_device.as<int>();
  // The FP8 launch of a case with a forward pipeline (which the wgrad does not use).
  using Fp8Launch = std::function<void(const Fp8Pipeline&)>;
  const auto forward = [&](const Operand& a, const Operand& w, const GroupedShape& shape,
                           ForwardOutput output) {
    return std::pair<Fp8Launch, std::function<void()>>{
        [a = &a, w = &w, shape, output, offs, out_data](const Fp8Pipeline& pipeline) {
          grouped_forward_fp8(shape, a->data.as<uint8_t>(), a->scales.as<float>(),
                              w->data.as<uint8_t>(), w->scales.as<float>(), offs, out_data, output,
                              nullptr, {}, pipeline);
        },
        [a = &a, w = &w, shape, output, offs, out_data] {
          grouped_forward(shape, a->values.as<mok::bf16>(), w->values.as<mok::bf16>(), offs,
                          out_data, output, nullptr);
        }};
  };
  // dgrad: the bf16 engine reads the forward weight (E, n, k), the FP8 kernel the transposed
  // quantization (same shape of work, other random values).
  const auto dgrad = [&](const Operand& grad, const Operand& w_t, const Operand& w,
                         const GroupedShape& shape) {
    return std::pair<Fp8Launch, std::function<void()>>{
        [grad = &grad, w_t = &w_t, shape, offs, out_data](const Fp8Pipeline& pipeline) {
          grouped_dgrad_fp8(shape, grad->data.as<uint8_t>(), grad->scales.as<float>(),
                            w_t->data.as<uint8_t>(), w_t->scales.as<float>(), offs, out_data,
                            DgradOutput::kBf16, nullptr, {}, pipeline);
        },
        [grad = &grad, w = &w, shape, offs, out_data] {
          grouped_dgrad(shape, grad->values.as<mok::bf16>(), w->values.as<mok::bf16>(), offs,
                        out_data, DgradOutput::kBf16, nullptr);
        }};
  };
  const auto wgrad = [&](const Operand& grad_t, const Operand& input_t, const GroupedShape& shape,
                         WgradOutput output) {
    return std::pair<Fp8Launch, std::function<void()>>{
        [grad_t = &grad_t, input_t = &input_t, shape, output, offs,
         out_data](const Fp8Pipeline& /*pipeline*/) {
          grouped_wgrad_fp8(shape, grad_t->data.as<uint8_t>(), grad_t->scales.as<float>(),
                            input_t->data.as<uint8_t>(), input_t->scales.as<float>(), offs,
                            out_data, output, nullptr);
        },
        [grad_t = &grad_t, input_t = &input_t, shape, output, offs, out_data] {
          grouped_wgrad(shape, grad_t->values.as<mok::bf16>(), input_t->values.as<mok::bf16>(),
                        offs, out_data, output, nullptr);
        }};
  };
  struct Case {
    const char* phase;
    GroupedShape shape;
    std::pair<Fp8Launch, std::function<void()>> launches;  // fp8, bf16
    bool has_pipeline;                                     // forward and dgrad
  };
  const Case cases[] = {
      {kPhases[0], gate_up, forward(x, w_gate_up, gate_up, ForwardOutput::kBf16), true},
      {kPhases[1], gate_up, forward(x, w_gate_up, gate_up, ForwardOutput::kSwiGluBf16), true},
      {kPhases[2], down, forward(h, w_down, down, ForwardOutput::kBf16), true},
      {kPhases[3], gate_up, dgrad(d_gate_up, w_gate_up_t, w_gate_up, gate_up), true},
      {kPhases[4], down, dgrad(dy, w_down_t, w_down, down), true},
      {kPhases[5], gate_up, wgrad(d_gate_up_t, x_t, gate_up, WgradOutput::kBf16), false},
      {kPhases[6], gate_up, wgrad(d_gate_up_t, x_t, gate_up, WgradOutput::kAccumulateFp32), false},
      {kPhases[7], down, wgrad(dy_t, h_t, down, WgradOutput::kBf16), false},
      {kPhases[8], down, wgrad(dy_t, h_t, down, WgradOutput::kAccumulateFp32), false},
  };
  std::vector<CaseResult> results;
  for (const Case& c : cases) {
    if (!only.empty() && only != c.phase) continue;
    // main_grad starts from zeros (the accumulating cases add to whatever is there).
    MOK_CUDA_CHECK(cudaMemset(out.data, 0, out_bytes));
    const double flops = 2.0 * rows_total * double(c.shape.n) * c.shape.k;
    const auto time_case = [&](const char* precision, const std::string& variant, int round,
                               const std::function<void()>& launch) {
      const double ms = median_ms(launch, iterations, warmup_ms);
      results.push_back(
          {c.phase, precision, variant, round, c.shape.n, c.shape.k, ms, flops / ms / 1e9});
      std::printf(
          "deepseek-v3 %-29s %-5s %-5s r%d E %3d rows %5d n %5d k %5d  %8.3f ms  %7.1f "
          "TFLOP/s\n",
          c.phase, precision, variant.c_str(), round, experts, rows, c.shape.n, c.shape.k, ms,
          results.back().tflops);
      std::fflush(stdout);
    };
    for (int round = 0; round < rounds; ++round) {
      const size_t num_variants = c.has_pipeline ? pipelines.size() : 1;
      for (size_t v = 0; v < num_variants; ++v) {
        const Fp8Pipeline pipeline = c.has_pipeline ? pipelines[v] : Fp8Pipeline{};
        time_case("fp8", c.has_pipeline ? variants[v] : "-", round,
                  [&] { c.launches.first(pipeline); });
      }
      time_case("bf16", "-", round, c.launches.second);
    }
  }
  MOK_CUDA_CHECK(cudaDeviceSynchronize());
  std::ofstream file(out_path);
  MOK_CHECK_ARG(file.good(), "--out", "cannot write '", out_path, "'");
  file << "[\n";
  for (size_t i = 0; i < results.size(); ++i) {
    const CaseResult& r = results[i];
    file << "  {\"preset\": \"deepseek-v3\", \"phase\": \"" << r.phase << "\", \"precision\": \""
         << r.precision << "\", \"variant\": \"" << r.variant << "\", \"round\": " << r.round
         << ", \"ep\": " << ep << ", \"num_experts\": " << experts
         << ", \"rows_per_expert\": " << rows << ", \"jitter\": " << jitter << ", \"n\": " << r.n
         << ", \"k\": " << r.k << ", \"mok_ms\": " << r.ms << ", \"useful_tflops\": " << r.tflops
         << "}" << (i + 1 < results.size() ? ",\n" : "\n");
  }
  file << "]\n";
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return mok::bench::run_main("bench_gemm_fp8", [&] { return run(argc, argv); });
}
