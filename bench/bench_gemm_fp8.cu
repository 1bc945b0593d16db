// Benchmark of the FP8 blockwise-scaled grouped GEMM (mok/gemm_fp8.hpp) at one rank of EP2 with
// balanced routing (2 ranks x 8192 tokens x top-8 = 65,536 rows over the rank's experts):
// deepseek-v3 gate/up (128 experts x 512 rows, 7168 -> 4096), plain and SwiGLU-fused, and down
// (2048 -> 7168), beside the bf16 engine on the same values (same device run, same clocks).
// Operands are random bf16 quantized on the GPU by mok's own quantizers (1 x 128 activations,
// 128 x 128 weights). Median of timed iterations with CUDA events after warm-up. Writes one JSON
// object per case to --out; bench/baselines/torch_scaled_grouped_mm.py times torch's rowwise
// FP8 grouped GEMM on the same shape.
//
//   bench_gemm_fp8 [--out FILE] [--iterations N] [--warmup-ms MS] [--only PHASE]
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

constexpr const char* kPhases[] = {"gemm-gateup", "gemm-gateup-swiglu", "gemm-down"};

constexpr char kUsage[] =
    R"(bench_gemm_fp8: the FP8 blockwise-scaled grouped GEMM (DeepSeek-V3 recipe) at deepseek-v3,
one rank of EP2 with balanced routing (65,536 rows over 128 experts), beside the bf16 engine on
the same values; one Hopper GPU.

usage: bench_gemm_fp8 [--out FILE] [--iterations N] [--warmup-ms MS] [--only PHASE]

  --out FILE       results, one JSON object per case and precision (default gemm-fp8-mok.json)
  --iterations N   timed iterations per case, median reported (default 20)
  --warmup-ms MS   untimed launches of each case for MS ms first (default 300)
  --only PHASE     one phase: gemm-gateup (7168 -> 4096), gemm-gateup-swiglu (the same with
                   SwiGLU fused, output 2048 wide) or gemm-down (2048 -> 7168)
)";

struct CaseResult {
  std::string phase, precision;
  int n, k;
  double ms, tflops;
};

int run(int argc, char** argv) {
  std::string out_path = "gemm-fp8-mok.json", only;
  int iterations = 20;
  double warmup_ms = 300;
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
        else
          return false;
        return true;
      });
  if (!go) return 0;
  if (iterations < 1) throw mok::bench::UsageError("--iterations", "must be >= 1");
  if (warmup_ms < 0) throw mok::bench::UsageError("--warmup-ms", "must be >= 0");
  if (!only.empty() && std::find_if(std::begin(kPhases), std::end(kPhases), [&](const char* p) {
                         return only == p;
                       }) == std::end(kPhases)) {
    throw mok::bench::UsageError("--only", "no phase is called '" + only + "'");
  }
  const mok::GpuSummary gpus = mok::query_gpus();
  if (gpus.num_hopper_gpus < 1)
    throw mok::Error("", "needs a Hopper GPU; found " + gpus.description);

  constexpr int kEp = 2, kTokensPerRank = 8192;
  const mok::LayerShape& layer = mok::find_preset("deepseek-v3").shape;
  const int experts = static_cast<int>(layer.num_experts / kEp);
  const int rows_total = static_cast<int>(kTokensPerRank * layer.top_k);
  const int rows = rows_total / experts;
  const int hidden = static_cast<int>(layer.hidden), inter = static_cast<int>(layer.intermediate);
  std::vector<int> offsets(experts + 1);
  for (int e = 0; e <= experts; ++e) offsets[e] = e * rows;
  Buffer offsets_device(offsets.size() * sizeof(int));
  MOK_CUDA_CHECK(cudaMemcpy(offsets_device.data, offsets.data(), offsets.size() * sizeof(int),
                            cudaMemcpyHostToDevice));
  const int* offs = offsets_device.as<int>();
  using mok::quantize::describe;
  using mok::quantize::Format;
  const Operand x(describe(Format::kFp8, 1, rows_total, hidden, 1, 128, false), 1, 1.0f);
  const Operand w_gate_up(describe(Format::kFp8, experts, 2 * inter, hidden, 128, 128, false), 2,
                          0.05f);
  const Operand h(describe(Format::kFp8, 1, rows_total, inter, 1, 128, false), 4, 1.0f);
  const Operand w_down(describe(Format::kFp8, experts, hidden, inter, 128, 128, false), 3, 0.05f);
  Buffer out(static_cast<size_t>(rows_total) * std::max(2 * inter, hidden) * 2);
  MOK_CUDA_CHECK(cudaDeviceSynchronize());

  struct Case {
    const char* phase;
    const Operand& a;
    const Operand& b;
    GroupedShape shape;
    ForwardOutput output;
  };
  const GroupedShape gate_up{experts, rows_total, 2 * inter, hidden};
  const GroupedShape down{experts, rows_total, hidden, inter};
  const Case cases[] = {{kPhases[0], x, w_gate_up, gate_up, ForwardOutput::kBf16},
                        {kPhases[1], x, w_gate_up, gate_up, ForwardOutput::kSwiGluBf16},
                        {kPhases[2], h, w_down, down, ForwardOutput::kBf16}};
  std::vector<CaseResult> results;
  for (const Case& c : cases) {
    if (!only.empty() && only != c.phase) continue;
    const double flops = 2.0 * rows_total * double(c.shape.n) * c.shape.k;
    const std::function<void()> fp8 = [&] {
      grouped_forward_fp8(c.shape, c.a.data.as<uint8_t>(), c.a.scales.as<float>(),
                          c.b.data.as<uint8_t>(), c.b.scales.as<float>(), offs, out.data, c.output,
                          nullptr);
    };
    const std::function<void()> bf16 = [&] {
      grouped_forward(c.shape, c.a.values.as<mok::bf16>(), c.b.values.as<mok::bf16>(), offs,
                      out.data, c.output, nullptr);
    };
    for (const auto& [precision, launch] :
         {std::pair<const char*, const std::function<void()>&>{"fp8", fp8}, {"bf16", bf16}}) {
      const double ms = median_ms(launch, iterations, warmup_ms);
      results.push_back({c.phase, precision, c.shape.n, c.shape.k, ms, flops / ms / 1e9});
      std::printf("deepseek-v3 %-20s %-5s E %3d rows %5d n %5d k %5d  %8.3f ms  %7.1f TFLOP/s\n",
                  c.phase, precision, experts, rows, c.shape.n, c.shape.k, ms,
                  results.back().tflops);
      std::fflush(stdout);
    }
  }
  MOK_CUDA_CHECK(cudaDeviceSynchronize());
  std::ofstream file(out_path);
  MOK_CHECK_ARG(file.good(), "--out", "cannot write '", out_path, "'");
  file << "[\n";
  for (size_t i = 0; i < results.size(); ++i) {
    const CaseResult& r = results[i];
    file << "  {\"preset\": \"deepseek-v3\", \"phase\": \"" << r.phase << "\", \"precision\": \""
         << r.precision << "\", \"num_experts\": " << experts << ", \"rows_per_expert\": " << rows
         << ", \"n\": " << r.n << ", \"k\": " << r.k << ", \"mok_ms\": " << r.ms
         << ", \"useful_tflops\": " << r.tflops << "}" << (i + 1 < results.size() ? ",\n" : "\n");
  }
  file << "]\n";
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return mok::bench::run_main("bench_gemm_fp8", [&] { return run(argc, argv); });
}
