// The GPU layer backward in fp8 (LayerBackwardFp8) against the CPU reference's fp8 mode and the
// fp64 oracle: every output (dx, d_topk_w, each weight gradient, main_grad accumulation) within the
// FP8 yardstick's rule (mok/compare.hpp) and no worse than torch's rowwise recipe, the transposed
// weight cache byte for byte, and the determinism contract bitwise: repeats, a replayed graph,
// GEMM and copy SM counts, EP 1 = 2 = 4 (emulated on one GPU where there is one).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <iostream>
#include <string>
#include <vector>

#include "backward_test_support.cuh"
#include "mok/compare.hpp"
#include "mok/quantize.hpp"
#include "reference/run.hpp"

namespace mok::comm_test {
namespace {

// H and I whole blocks of 128 (I two of them), a shared expert of one block, top-4.
Problem fp8_problem(const Case& which, int64_t num_tokens, uint64_t seed) {
  return testing::make_problem(which, num_tokens, seed, LayerShape{256, 256, 128, 16, 4});
}

BackwardRun fp8_run() {
  BackwardRun run;
  run.precision = Precision::kFp8;
  return run;
}

// Forward + backward of the CPU backend under `recipe`, all ranks (the forward fills y only).
ProblemOutputs cpu_outputs(const Problem& problem, int ep, const reference::QuantRecipe& recipe,
                           const BackwardRun& run) {
  ProblemOutputs outputs = ProblemOutputs::poisoned(problem, ep);
  if (run.mode == GradMode::kAccumulate) {
    for (auto* grad :
         {&outputs.grad_gate, &outputs.grad_up, &outputs.grad_down, &outputs.grad_shared_gate,
          &outputs.grad_shared_up, &outputs.grad_shared_down}) {
      grad->assign(grad->size(), run.main_grad_start);
    }
  }
  const std::vector<reference::RankInputs> inputs = problem.all_rank_inputs(ep);
  const std::vector<reference::RankOutputs> views = outputs.rank_outputs(problem);
  reference::run_backward(problem.shape, inputs, views, run.mode, {}, &recipe);
  return outputs;
}

// The FP8 rule for each output: its error against the fp64 oracle of the bf16 inputs within
// kFp8YardstickTolerance of the yardstick's (the same quantized operands, everything else in
// fp64: what the recipe itself costs) and no larger than the rowwise recipe's (one scale per row
// of every operand, torch._scaled_grouped_mm's); the CPU reference meets the same rule here.
void expect_fp8_accuracy(const Problem& problem, int ep, const BackwardOutputs& gpu,
                         const BackwardRun& run) {
  const std::vector<reference::RankInputs> ranks = problem.all_rank_inputs(ep);
  const std::vector<reference::OracleResult> exact = reference::oracle(problem.shape, ranks, true);
  reference::Options quantized;
  quantized.precision = Precision::kFp8;
  const std::vector<reference::OracleResult> yardstick =
      reference::oracle(problem.shape, ranks, true, quantized);
  const ProblemOutputs cpu =
      cpu_outputs(problem, ep, reference::QuantRecipe::of(Precision::kFp8), run);
  const ProblemOutputs rowwise =
      cpu_outputs(problem, ep, reference::QuantRecipe::rowwise_fp8(), run);
  const double offset = run.mode == GradMode::kAccumulate ? run.main_grad_start : 0.0;
  const auto joined = [&](const std::vector<reference::OracleResult>& results, auto member,
                          double add) {
    std::vector<double> values;
    for (const reference::OracleResult& rank : results) {
      for (double value : rank.*member) values.push_back(value + add);
    }
    return values;
  };
  const auto check = [&](const char* name, const auto& gpu_values, const auto& cpu_values,
                         const auto& rowwise_values, auto member, double add) {
    SCOPED_TRACE(name);
    const std::vector<double> oracle = joined(exact, member, add);
    const std::vector<double> quantized_oracle = joined(yardstick, member, add);
    ASSERT_EQ(gpu_values.size(), oracle.size());
    const ErrorStats gpu_error = compare(gpu_values, oracle);
    const ErrorStats cpu_error = compare(cpu_values, oracle);
    const ErrorStats rowwise_error = compare(rowwise_values, oracle);
    // The yardstick in fp64 against fp64 (compare takes float or bf16 values).
    double diff = 0, norm = 0;
    for (size_t index = 0; index < oracle.size(); ++index) {
      diff += (quantized_oracle[index] - oracle[index]) * (quantized_oracle[index] - oracle[index]);
      norm += (oracle[index] - add) * (oracle[index] - add);
    }
    const double yardstick_error = std::sqrt(diff / std::max(norm, 1e-300));
    std::cout << "[ accuracy ] fp8 backward " << name << " vs fp64: GPU " << gpu_error.relative_l2
              << ", CPU reference " << cpu_error.relative_l2 << ", quantized operands in fp64 "
              << yardstick_error << ", rowwise recipe " << rowwise_error.relative_l2 << "\n";
    EXPECT_EQ(gpu_error.non_finite, 0) << "unwritten (NaN) elements";
    if (add == 0.0) {  // (accumulating, the start value dominates the relative errors)
      EXPECT_LE(std::fabs(gpu_error.relative_l2 - yardstick_error),
                kFp8YardstickTolerance * yardstick_error)
          << "GPU: " << gpu_error.describe() << "; yardstick " << yardstick_error;
      EXPECT_LE(std::fabs(cpu_error.relative_l2 - yardstick_error),
                kFp8YardstickTolerance * yardstick_error)
          << "CPU reference: " << cpu_error.describe() << "; yardstick " << yardstick_error;
      EXPECT_GT(yardstick_error, 0x1p-7) << "no quantization error at all?";
    }
    // (d_topk_w has one value per routed slot: too few for 5 % between two recipes' noise; the
    // yardstick rule above pins it to the blockwise recipe.)
    if (std::string(name) != "d_topk_w") {
      EXPECT_LE(gpu_error.relative_l2, (1 + kFp8YardstickTolerance) * rowwise_error.relative_l2)
          << "GPU " << gpu_error.describe() << " against the rowwise recipe's "
          << rowwise_error.relative_l2;
    }
  };
  using R = reference::OracleResult;
  check("dx", gpu.dx, cpu.dx, rowwise.dx, &R::dx, 0.0);
  check("d_topk_w", gpu.d_topk_w, cpu.d_topk_w, rowwise.d_topk_w, &R::d_topk_w, 0.0);
  check("grad_gate", gpu.grad_gate, cpu.grad_gate, rowwise.grad_gate, &R::grad_gate, offset);
  check("grad_up", gpu.grad_up, cpu.grad_up, rowwise.grad_up, &R::grad_up, offset);
  check("grad_down", gpu.grad_down, cpu.grad_down, rowwise.grad_down, &R::grad_down, offset);
  if (problem.shape.has_shared()) {
    check("grad_shared_gate", gpu.grad_shared_gate, cpu.grad_shared_gate, rowwise.grad_shared_gate,
          &R::grad_shared_gate, offset);
    check("grad_shared_up", gpu.grad_shared_up, cpu.grad_shared_up, rowwise.grad_shared_up,
          &R::grad_shared_up, offset);
    check("grad_shared_down", gpu.grad_shared_down, cpu.grad_shared_down, rowwise.grad_shared_down,
          &R::grad_shared_down, offset);
  }
  for (size_t slot = 0; slot < gpu.d_topk_w.size(); ++slot) {
    if (problem.topk_idx[slot] < 0) {
      ASSERT_EQ(gpu.d_topk_w[slot], 0.0f) << "unused slot " << slot;
    }
  }
}

TEST(LayerBackwardFp8, TransposedWeightsAreTheForwardBlocksTransposed) {
  MOK_REQUIRE_HOPPER_GPUS(1);
  const Problem problem = fp8_problem({"uniform", 0.0, false, true}, 64, 51);
  const LayerShape& shape = problem.shape;
  const reference::RankInputs inputs = problem.rank_inputs(0, 1);
  const int64_t experts = shape.num_experts, hidden = shape.hidden, inter = shape.intermediate;
  // Special values in some blocks (the quantizer's packed maximum and its general path for the
  // threads that hold a non-finite value): NaN, +-Inf, +-the largest finite bf16, a block of
  // zeros, a block of subnormals of both signs.
  std::vector<bf16> gate = host_vector(inputs.weights.gate), up = host_vector(inputs.weights.up),
                    down = host_vector(inputs.weights.down);
  gate[5] = bf16::from_bits(0x7fc1);                                 // NaN, expert 0
  gate[(3 * inter + 200) * hidden + 130] = bf16::from_bits(0xff80);  // -Inf, expert 3
  gate[(1 * inter + 7) * hidden + 9] = bf16::from_bits(0x7f7f);      // largest finite
  down[(2 * hidden + 140) * inter + 3] = bf16::from_bits(0x7f80);    // +Inf, expert 2
  down[(5 * hidden + 1) * inter + 250] = bf16::from_bits(0xff7f);    // -largest
  for (int64_t r = 128; r < 256; ++r) {
    for (int64_t c = 0; c < 128; ++c) {
      down[(4 * hidden + r) * inter + c] =
          bf16::from_bits(static_cast<uint16_t>(0x8000 * (c % 2)));  // +-0
      up[(6 * inter + r) * hidden + 128 + c] =
          bf16::from_bits(static_cast<uint16_t>(0x8000 * (r % 2) + 1 + (r * 7 + c) % 127));
    }
  }
  LayerWeights special = inputs.weights;
  special.gate = View<const bf16>(gate.data(), inputs.weights.gate.shape);
  special.up = View<const bf16>(up.data(), inputs.weights.up.shape);
  special.down = View<const bf16>(down.data(), inputs.weights.down.shape);
  const RankDeviceWeights weights(special, shape);
  Fp8WeightCache cache(shape, shape.num_experts, /*transposed=*/true);
  cache.quantize(weights.view(), nullptr);
  MOK_CUDA_CHECK(cudaDeviceSynchronize());
  // Each transposed matrix is quantize_cpu of the bf16 matrix transposed (128 x 128 blocks: the
  // same squares): gate/up's columns the gate rows, then the up rows.
  const auto expect_transposed = [&](const std::vector<bf16>& first,
                                     const std::vector<bf16>& second, int64_t batch, int64_t rows,
                                     int64_t cols, const Fp8Operand& device, const char* name) {
    SCOPED_TRACE(name);
    const int64_t parts = second.empty() ? 1 : 2;
    const int64_t out_cols = parts * rows;  // (cols, parts * rows) per matrix
    const quantize::Layout layout =
        quantize::describe(quantize::Format::kFp8, 1, cols, out_cols, 128, 128, false);
    std::vector<uint8_t> expected(static_cast<size_t>(batch * cols * out_cols)),
        got(expected.size()), part(static_cast<size_t>(cols * out_cols));
    std::vector<float> expected_scales(static_cast<size_t>(batch * layout.num_scales())),
        got_scales(expected_scales.size()), part_scales(static_cast<size_t>(layout.num_scales()));
    std::vector<bf16> transposed(static_cast<size_t>(cols * out_cols));
    for (int64_t e = 0; e < batch; ++e) {
      for (int64_t p = 0; p < parts; ++p) {
        const std::vector<bf16>& source = p == 0 ? first : second;
        for (int64_t r = 0; r < rows; ++r) {
          for (int64_t c = 0; c < cols; ++c) {
            transposed[c * out_cols + p * rows + r] = source[(e * rows + r) * cols + c];
          }
        }
      }
      quantize::quantize_cpu(layout, transposed.data(), quantize::InputType::kBf16, part.data(),
                             part_scales.data());
      std::copy(part.begin(), part.end(), expected.begin() + e * cols * out_cols);
      std::copy(part_scales.begin(), part_scales.end(),
                expected_scales.begin() + e * layout.num_scales());
    }
    MOK_CUDA_CHECK(cudaMemcpy(got.data(), device.data, got.size(), cudaMemcpyDeviceToHost));
    MOK_CUDA_CHECK(cudaMemcpy(got_scales.data(), device.scales, got_scales.size() * 4,
                              cudaMemcpyDeviceToHost));
    EXPECT_EQ(got, expected);
    EXPECT_EQ(std::memcmp(got_scales.data(), expected_scales.data(), got_scales.size() * 4), 0);
  };
  const Fp8LayerWeights& transposed = cache.transposed();
  expect_transposed(gate, up, experts, inter, hidden, transposed.gate_up, "gate/up");
  expect_transposed(down, {}, experts, hidden, inter, transposed.down, "down");
  expect_transposed(host_vector(inputs.weights.shared_gate), host_vector(inputs.weights.shared_up),
                    1, shape.shared_intermediate, hidden, transposed.shared_gate_up,
                    "shared gate/up");
  expect_transposed(host_vector(inputs.weights.shared_down), {}, 1, hidden,
                    shape.shared_intermediate, transposed.shared_down, "shared down");
}

class LayerBackwardFp8Routings : public ::testing::TestWithParam<Case> {};

TEST_P(LayerBackwardFp8Routings, MatchesReferenceRuleAndRepeatsBitwise) {
  MOK_REQUIRE_HOPPER_GPUS(1);
  const Problem problem = fp8_problem(GetParam(), 301, 53);
  BackwardRun run = fp8_run();
  run.repeats = 2;
  const BackwardOutputs gpu = run_gpu_backward(problem, 1, run);
  expect_fp8_accuracy(problem, 1, gpu, run);
  // One token: too few values for relative errors to mean much; every output written, the
  // unused slots' d_topk_w zero, and the same bits again.
  const Problem one = fp8_problem(GetParam(), 1, 55);
  const BackwardOutputs single = run_gpu_backward(one, 1, run);
  for (const bf16 value : single.dx) ASSERT_TRUE(std::isfinite(value.to_float()));
  for (const float value : single.grad_down) ASSERT_TRUE(std::isfinite(value));
}

INSTANTIATE_TEST_SUITE_P(Routings, LayerBackwardFp8Routings,
                         ::testing::Values(Case{"uniform", 0.1, true, true},
                                           Case{"skewed:4", 0.0, false, false},
                                           Case{"single-expert", 0.0, true, true}),
                         [](const auto& info) { return case_name(info.param); });

TEST(LayerBackwardFp8, AccumulatesIntoMainGrad) {
  MOK_REQUIRE_HOPPER_GPUS(1);
  const Problem problem = fp8_problem({"uniform", 0.1, true, true}, 200, 57);
  BackwardRun accumulate = fp8_run();
  accumulate.mode = GradMode::kAccumulate;
  accumulate.main_grad_start = 0.25f;
  const BackwardOutputs fresh = run_gpu_backward(problem, 1, fp8_run());
  const BackwardOutputs added = run_gpu_backward(problem, 1, accumulate);
  expect_fp8_accuracy(problem, 1, added, accumulate);
  // main_grad + the sum: the start value, then the blocks in order (not the rounded fresh sum
  // added to it), so only close to start + fresh.
  for (size_t index = 0; index < fresh.grad_gate.size(); ++index) {
    ASSERT_NEAR(added.grad_gate[index], 0.25f + fresh.grad_gate[index],
                1e-5f + 1e-5f * std::fabs(fresh.grad_gate[index]))
        << "grad_gate " << index;
  }
}

TEST(LayerBackwardFp8, KnobsGraphAndEpDoNotChangeABit) {
  MOK_REQUIRE_HOPPER_GPUS(1);
  const Problem problem = fp8_problem({"skewed:1.2", 0.1, true, true}, 4 * 71, 59);
  BackwardRun run = fp8_run();
  run.use_graph = true;  // run_gpu_backward throws if a replay differs from the eager run
  const BackwardOutputs expected = run_gpu_backward(problem, 1, run);
  expect_fp8_accuracy(problem, 1, expected, run);
  std::vector<BackwardRun> knobs(4, fp8_run());
  knobs[0].layer.gemm.num_sms = 37;
  knobs[0].layer.copy = {5, 256};
  knobs[1].layer.gemm.num_sms = 8;
  knobs[1].layer.overlap_shared_with_dispatch = false;
  knobs[1].layer.local_dispatch_on_every_sm = false;
  knobs[2].layer.copy = {64, 512};
  knobs[3].fp8_pipeline = {2, 3};  // clusters of 2, 3 stages
  for (size_t index = 0; index < knobs.size(); ++index) {
    const BackwardOutputs other = run_gpu_backward(problem, 1, knobs[index]);
    EXPECT_EQ(first_different_tensor(other, expected), "") << "knob setting " << index;
    EXPECT_TRUE(same_bits(other.grad_shared_gate, expected.grad_shared_gate) &&
                same_bits(other.grad_shared_down, expected.grad_shared_down))
        << "knob setting " << index << ": shared expert gradients differ";
  }
  for (int ep : {2, 4}) {
    EXPECT_EQ(first_different_tensor(run_gpu_backward(problem, ep, fp8_run()), expected), "")
        << "EP " << ep << " differs from EP 1";
  }
}

// Save mode (LayerForwardFp8 keeps the gate/up pre-activations from its SwiGLU epilogue, the
// backward reads them): the recompute's bits in every output, shared expert included, at EP 1
// and EP 2, with repeats (each run's forward writes the poisoned context again).
TEST(LayerBackwardFp8, SaveModeGivesRecomputesBits) {
  MOK_REQUIRE_HOPPER_GPUS(1);
  for (const Case& routing :
       {Case{"skewed:1.2", 0.1, true, true}, Case{"uniform", 0.0, false, false}}) {
    const Problem problem = fp8_problem(routing, 2 * 97, 61);
    BackwardRun save = fp8_run();
    save.save = true;
    save.repeats = 1;
    for (int ep : {1, 2}) {
      const BackwardOutputs recomputed = run_gpu_backward(problem, ep, fp8_run());
      const BackwardOutputs saved = run_gpu_backward(problem, ep, save);
      EXPECT_EQ(first_different_tensor(saved, recomputed), "")
          << case_name(routing) << ", EP " << ep << ": save mode differs from recompute mode";
      EXPECT_TRUE(same_bits(saved.grad_shared_gate, recomputed.grad_shared_gate) &&
                  same_bits(saved.grad_shared_up, recomputed.grad_shared_up) &&
                  same_bits(saved.grad_shared_down, recomputed.grad_shared_down))
          << case_name(routing) << ", EP " << ep << ": shared expert gradients differ";
    }
  }
}

TEST(LayerBackwardFp8, RefusesCachesItCannotRead) {
  MOK_REQUIRE_HOPPER_GPUS(1);
  const Problem problem = fp8_problem({"uniform", 0.0, false, true}, 8, 3);
  const LayerShape& shape = problem.shape;
  LayerBackwardFp8 layer(local_communicators(1)[0], shape, 8);
  const RankDeviceWeights weights(problem.rank_inputs(0, 1).weights, shape);
  const LayerShape narrower{256, 128, 128, 16, 4};
  const Problem other = testing::make_problem({"uniform", 0.0, false, true}, 8, 3, narrower);
  const RankDeviceWeights other_weights(other.rank_inputs(0, 1).weights, narrower);
  Fp8WeightCache empty(shape, shape.num_experts, true);
  Fp8WeightCache forward_only(shape, shape.num_experts, false);
  forward_only.quantize(weights.view(), nullptr);
  Fp8WeightCache other_shape(narrower, shape.num_experts, true);
  other_shape.quantize(other_weights.view(), nullptr);
  MOK_CUDA_CHECK(cudaDeviceSynchronize());
  for (const Fp8WeightCache* cache : {&empty, &forward_only, &other_shape}) {
    try {
      layer.backward(*cache, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, {}, 0, nullptr);
      FAIL() << "a cache the backward cannot read was accepted";
    } catch (const Error& error) {
      EXPECT_NE(std::string(error.what()).find("weights"), std::string::npos) << error.what();
    }
  }
}

}  // namespace
}  // namespace mok::comm_test
