// The CPU reference, which is also mok's CPU backend. It computes one MoE layer for R virtual
// expert-parallel ranks with the rounding points of the GPU design (DESIGN.md §1) and emulates
// dispatch and combine: the rows of an expert are taken in global-token order (rank, token), so
// every result is bitwise identical for R = 1, 2, 4, ... — the contract the GPU must meet.
//
// The GEMMs accumulate in fp32 in natural K order (a plain sequential sum); the GPU's tensor cores
// sum in another order, so GPU and reference agree to rounding, not bitwise, except where a test
// says otherwise. In the FP8 modes (Options::precision) the GEMM operands are E4M3 with the
// quantizers' bytes and scales (mok/quantize.hpp), quantized at the points docs/quantize.md lists,
// and each K sum is promoted into fp32 once per block, as the GPU's FP8 GEMM does; everything
// else (SwiGLU, combine, the bf16 stores) is the bf16 path's.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <string_view>
#include <vector>

#include "mok/layer.hpp"
#include "mok/precision.hpp"

namespace mok::reference {

struct Options {
  int num_threads = 0;  // 0 = every hardware thread; results never depend on it
  // The precision mode. kFp8 needs H, I and I_s multiples of 128; kMxfp8 multiples of 32.
  Precision precision = Precision::kBf16;
  // Called now and then from one thread while a phase runs: (phase, items done, items in all).
  std::function<void(std::string_view phase, int64_t done, int64_t total)> progress;
};

// One virtual rank's inputs. `dy` (T, H) is read by backward only.
struct RankInputs {
  TokenBatch tokens;
  LayerWeights weights;
  View<const bf16> dy;
};

// One virtual rank's outputs; forward writes `y`, backward the rest.
struct RankOutputs {
  View<bf16> y;          // (T, H)
  View<bf16> dx;         // (T, H)
  View<float> d_topk_w;  // (T, k); 0 in unused (-1) slots
  WeightGrads grads;     // this rank's local experts and its share of the shared expert
};

// R = ranks.size(). Validates every argument first (mok::Error on bad input), then computes.
void forward(const LayerShape& shape, std::span<const RankInputs> ranks,
             std::span<const RankOutputs> outputs, const Options& options = {});

// Recomputes the forward internally (nothing is saved between the calls).
void backward(const LayerShape& shape, std::span<const RankInputs> ranks,
              std::span<const RankOutputs> outputs, GradMode mode, const Options& options = {});

// The same layer in fp64 with no intermediate rounding: the accuracy oracle. Weight gradients
// start from zero. With options.precision kFp8 or kMxfp8: the layer from the same quantized
// operands (the same quantization points, bytes and scales, each quantized from the fp64 value
// rounded to fp32) with every other operation in fp64 and nothing stored in bf16 — what the
// quantization alone costs, the yardstick of the FP8 accuracy tests.
struct OracleResult {
  std::vector<double> y, dx, d_topk_w;
  std::vector<double> grad_gate, grad_up, grad_down;
  std::vector<double> grad_shared_gate, grad_shared_up, grad_shared_down;
};
std::vector<OracleResult> oracle(const LayerShape& shape, std::span<const RankInputs> ranks,
                                 bool with_backward, const Options& options = {});

}  // namespace mok::reference
