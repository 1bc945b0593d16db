// The GPU layer forward in fp8 (LayerForwardFp8) against the CPU reference's fp8 mode: the
// weight cache byte for byte (W_gate and W_up in blocks of their own, as the reference quantizes
// them), y within the FP8 yardstick's rule of the fp64 oracle and no worse than torch's rowwise
// recipe, and the determinism contract bitwise: repeats, a replayed graph, GEMM and copy SM
// counts, EP 1 = 2 = 4 (emulated on one GPU where there is one).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "layer_test_support.cuh"
#include "mok/quantize.hpp"
#include "mok/reference.hpp"
#include "reference/run.hpp"
#include "runtime/comm_ops.hpp"
#include "runtime/layer_forward_fp8.hpp"

namespace mok::comm_test {
namespace {

// H and I whole blocks of 128, I two of them (a 128-block of h per quad of SwiGLU columns), top-4.
Problem fp8_problem(const Case& which, int64_t num_tokens, uint64_t seed) {
  return testing::make_problem(which, num_tokens, seed, LayerShape{256, 256, 128, 16, 4});
}

struct Fp8Run {
  LayerForwardFp8Options options;
  int repeats = 1;
  bool use_graph = false;
};

// The fp8 forward on every rank: weights quantized once, outputs and the rows in between
// NaN-poisoned before each run, every run's y the first one's bits. Returns y of all ranks.
std::vector<bf16> run_gpu_fp8_layer(const Problem& problem, int ep, const Fp8Run& run) {
  const std::vector<Communicator>& comms = test_communicators(ep);
  const int64_t tokens = problem.num_tokens / ep, hidden = problem.shape.hidden;
  std::vector<bf16> y_all(static_cast<size_t>(problem.num_tokens * hidden));
  for_each_rank(ep, [&](int rank) {
    MOK_CUDA_CHECK(cudaSetDevice(comms[rank].device()));
    const reference::RankInputs inputs = problem.rank_inputs(rank, ep);
    LayerForwardFp8 layer(comms[rank], problem.shape, tokens, run.options);
    const RankDeviceWeights weights(inputs.weights, problem.shape);
    DeviceBuffer<bf16> x(host_vector(inputs.tokens.x));
    DeviceBuffer<int32_t> topk_idx(host_vector(inputs.tokens.topk_idx));
    DeviceBuffer<float> topk_w(host_vector(inputs.tokens.topk_w));
    DeviceBuffer<bf16> y(static_cast<size_t>(tokens * hidden));
    cudaStream_t stream = nullptr;
    MOK_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    layer.quantize_weights(weights.view(), stream);
    MOK_CUDA_CHECK(cudaStreamSynchronize(stream));
    CommWorkspace& ws = layer.workspace();
    const size_t row_bytes = static_cast<size_t>(ws.layout().row_bytes());
    auto poison = [&] {
      MOK_CUDA_CHECK(cudaMemsetAsync(y.get(), 0xff, y.bytes(), stream));
      MOK_CUDA_CHECK(cudaMemsetAsync(ws.slots(), 0xff, ws.layout().slot_rows * row_bytes, stream));
      MOK_CUDA_CHECK(
          cudaMemsetAsync(ws.expert_x(), 0xff, ws.layout().expert_rows * row_bytes, stream));
      MOK_CUDA_CHECK(
          cudaMemsetAsync(ws.expert_y(), 0xff, ws.layout().expert_y_rows * row_bytes, stream));
    };
    auto enqueue = [&] {
      layer.forward(x.get(), topk_idx.get(), topk_w.get(), y.get(), tokens, stream);
    };
    const std::vector<bf16> first = first_run_then_repeats(
        comms[rank], rank, stream, layer, y, run.repeats, run.use_graph, poison, enqueue);
    MOK_CUDA_CHECK(cudaStreamDestroy(stream));
    std::memcpy(y_all.data() + rank * tokens * hidden, first.data(), first.size() * sizeof(bf16));
  });
  return y_all;
}

std::vector<double> oracle_y(const Problem& problem, int ep, Precision precision) {
  reference::Options options;
  options.precision = precision;
  std::vector<double> y;
  for (const reference::OracleResult& rank :
       reference::oracle(problem.shape, problem.all_rank_inputs(ep), false, options)) {
    y.insert(y.end(), rank.y.begin(), rank.y.end());
  }
  return y;
}

// y of the CPU backend under `recipe` (QuantRecipe::of(kFp8): the reference; rowwise_fp8: one
// scale per row of every operand, torch._scaled_grouped_mm's recipe).
std::vector<bf16> cpu_y(const Problem& problem, int ep, const reference::QuantRecipe& recipe) {
  const std::vector<reference::RankInputs> inputs = problem.all_rank_inputs(ep);
  ProblemOutputs outputs = ProblemOutputs::poisoned(problem, ep);
  const std::vector<reference::RankOutputs> rank_outputs = outputs.rank_outputs(problem);
  reference::run_forward(problem.shape, inputs, rank_outputs, {}, &recipe);
  return outputs.y;
}

// The FP8 rule (mok/compare.hpp): y's error against the fp64 oracle of the bf16 inputs within
// kFp8YardstickTolerance of the yardstick's (the same quantized operands, all else in fp64) — the
// error the recipe itself costs — and no larger than the rowwise recipe's; the CPU reference passes
// the same rule in the same test.
void expect_fp8_accuracy(const Problem& problem, int ep, const std::vector<bf16>& y) {
  const std::vector<double> exact = oracle_y(problem, ep, Precision::kBf16);
  const std::vector<double> yardstick_y = oracle_y(problem, ep, Precision::kFp8);
  const ErrorStats gpu = compare(y, exact);
  const ErrorStats cpu =
      compare(cpu_y(problem, ep, reference::QuantRecipe::of(Precision::kFp8)), exact);
  const ErrorStats rowwise =
      compare(cpu_y(problem, ep, reference::QuantRecipe::rowwise_fp8()), exact);
  const ErrorStats yardstick = compare(yardstick_y, exact);
  const ErrorStats gpu_vs_yardstick = compare(y, yardstick_y);
  std::cout << "[ accuracy ] fp8 layer y vs fp64: GPU " << gpu.relative_l2 << ", CPU reference "
            << cpu.relative_l2 << ", quantized operands in fp64 " << yardstick.relative_l2
            << ", rowwise recipe " << rowwise.relative_l2 << "; GPU vs the quantized fp64 "
            << gpu_vs_yardstick.relative_l2 << "\n";
  EXPECT_EQ(gpu.non_finite, 0) << "unwritten (NaN) elements in y";
  EXPECT_LE(std::fabs(gpu.relative_l2 - yardstick.relative_l2),
            kFp8YardstickTolerance * yardstick.relative_l2)
      << "GPU: " << gpu.describe() << "; yardstick " << yardstick.relative_l2;
  EXPECT_LE(std::fabs(cpu.relative_l2 - yardstick.relative_l2),
            kFp8YardstickTolerance * yardstick.relative_l2)
      << "CPU reference: " << cpu.describe() << "; yardstick " << yardstick.relative_l2;
  EXPECT_LE(gpu.relative_l2, (1 + kFp8YardstickTolerance) * rowwise.relative_l2)
      << "GPU " << gpu.relative_l2 << " against the rowwise recipe's " << rowwise.relative_l2;
  EXPECT_GT(yardstick.relative_l2, 0x1p-7) << "no quantization error at all?";
}

TEST(LayerForwardFp8, WeightCacheIsTheReferenceQuantization) {
  MOK_REQUIRE_HOPPER_GPUS(1);
  const Problem problem = fp8_problem({"uniform", 0.0, false, true}, 64, 41);
  const LayerShape& shape = problem.shape;
  const reference::RankInputs inputs = problem.rank_inputs(0, 1);
  LayerForwardFp8 layer(local_communicators(1)[0], shape, 64);
  const RankDeviceWeights weights(inputs.weights, shape);
  layer.quantize_weights(weights.view(), nullptr);
  MOK_CUDA_CHECK(cudaDeviceSynchronize());
  const int64_t experts = shape.num_experts, hidden = shape.hidden, inter = shape.intermediate;
  // The reference's blocks: W_gate and W_up of each expert apart, W_down as it is. The cache
  // interleaves gate and up rows in blocks of 128 (gemm::kSwiGluFp8Interleave): its row block 2b
  // is W_gate's row block b, 2b + 1 W_up's, bytes and scale alike.
  auto expect_blocks = [&](const std::vector<bf16>& first, const std::vector<bf16>& second,
                           int64_t batch, int64_t rows, int64_t cols, const Fp8Operand& device,
                           const char* name) {
    SCOPED_TRACE(name);
    const quantize::Layout single =
        quantize::describe(quantize::Format::kFp8, 1, rows, cols, 128, 128, false);
    const int64_t parts = second.empty() ? 1 : 2;
    const int64_t matrix = rows * cols, matrix_scales = single.num_scales();
    const int64_t block_rows = single.scale_rows(), scale_cols = single.scale_cols();
    std::vector<uint8_t> data(static_cast<size_t>(parts * batch * matrix)),
        device_data(data.size()), part_data(static_cast<size_t>(matrix));
    std::vector<float> scales(static_cast<size_t>(parts * batch * matrix_scales)),
        device_scales(scales.size()), part_scales(static_cast<size_t>(matrix_scales));
    for (int64_t e = 0; e < batch; ++e) {
      for (int64_t part = 0; part < parts; ++part) {
        const std::vector<bf16>& source = part == 0 ? first : second;
        quantize::quantize_cpu(single, source.data() + e * matrix, quantize::InputType::kBf16,
                               part_data.data(), part_scales.data());
        for (int64_t block = 0; block < block_rows; ++block) {  // to row block parts * b + part
          const int64_t to = e * parts * block_rows + parts * block + part;
          std::copy_n(part_data.begin() + block * 128 * cols, 128 * cols,
                      data.begin() + to * 128 * cols);
          std::copy_n(part_scales.begin() + block * scale_cols, scale_cols,
                      scales.begin() + to * scale_cols);
        }
      }
    }
    MOK_CUDA_CHECK(
        cudaMemcpy(device_data.data(), device.data, device_data.size(), cudaMemcpyDeviceToHost));
    MOK_CUDA_CHECK(cudaMemcpy(device_scales.data(), device.scales, device_scales.size() * 4,
                              cudaMemcpyDeviceToHost));
    EXPECT_EQ(device_data, data);
    EXPECT_EQ(std::memcmp(device_scales.data(), scales.data(), scales.size() * 4), 0);
  };
  expect_blocks(host_vector(inputs.weights.gate), host_vector(inputs.weights.up), experts, inter,
                hidden, layer.weights().gate_up, "gate/up");
  expect_blocks(host_vector(inputs.weights.down), {}, experts, hidden, inter, layer.weights().down,
                "down");
  expect_blocks(host_vector(inputs.weights.shared_gate), host_vector(inputs.weights.shared_up), 1,
                shape.shared_intermediate, hidden, layer.weights().shared_gate_up,
                "shared gate/up");
}

class LayerForwardFp8Routings : public ::testing::TestWithParam<Case> {};

TEST_P(LayerForwardFp8Routings, MatchesReferenceRuleAndRepeatsBitwise) {
  MOK_REQUIRE_HOPPER_GPUS(1);
  for (int64_t tokens : {int64_t{1}, int64_t{301}}) {
    SCOPED_TRACE(std::to_string(tokens) + " tokens");
    const Problem problem = fp8_problem(GetParam(), tokens, 43);
    Fp8Run run;
    run.repeats = 2;
    const std::vector<bf16> y = run_gpu_fp8_layer(problem, 1, run);
    if (tokens > 1) expect_fp8_accuracy(problem, 1, y);
    // The SwiGLU quantization in the GEMM's epilogue gives the separate kernel's bytes (whole
    // tiles for short blocks too: one token, a single expert's 45-row tail).
    Fp8Run separate;
    separate.options.swiglu = Fp8SwiGlu::kSeparate;
    EXPECT_EQ(first_difference(run_gpu_fp8_layer(problem, 1, separate), y), -1)
        << "SwiGLU in the gate/up GEMM differs from the separate kernel";
    // (one token: too few values for relative errors to mean much; its bits must still be
    // those of the same token in a run of its own, which the EP test covers)
    std::vector<double> reference;
    for (const bf16 value : cpu_y(problem, 1, reference::QuantRecipe::of(Precision::kFp8))) {
      reference.push_back(value.to_float());
    }
    const ErrorStats cpu = compare(y, reference);
    EXPECT_TRUE(cpu.within(0.02)) << "GPU vs the CPU fp8 reference: " << cpu.describe();
  }
}

INSTANTIATE_TEST_SUITE_P(Routings, LayerForwardFp8Routings,
                         ::testing::Values(Case{"uniform", 0.1, true, true},
                                           Case{"skewed:4", 0.0, false, false},
                                           Case{"single-expert", 0.0, true, true}),
                         [](const auto& info) { return case_name(info.param); });

TEST(LayerForwardFp8, KnobsGraphAndEpDoNotChangeABit) {
  MOK_REQUIRE_HOPPER_GPUS(1);
  const Problem problem = fp8_problem({"skewed:1.2", 0.1, true, true}, 4 * 71, 47);
  Fp8Run run;
  run.use_graph = true;
  const std::vector<bf16> expected = run_gpu_fp8_layer(problem, 1, run);
  expect_fp8_accuracy(problem, 1, expected);
  std::vector<Fp8Run> knobs(4);
  knobs[0].options.layer.gemm.num_sms = 37;
  knobs[0].options.layer.copy = {5, 256};
  knobs[1].options.layer.gemm.num_sms = 8;
  knobs[1].options.layer.overlap_shared_with_dispatch = false;
  knobs[2].options.layer.copy = {64, 512};
  knobs[3].options.pipeline = {1, 3};  // single CTAs, 3 stages
  for (size_t index = 0; index < knobs.size(); ++index) {
    EXPECT_EQ(first_difference(run_gpu_fp8_layer(problem, 1, knobs[index]), expected), -1)
        << "knob setting " << index;
  }
  for (int ep : {2, 4}) {
    EXPECT_EQ(first_difference(run_gpu_fp8_layer(problem, ep, Fp8Run{}), expected), -1)
        << "EP " << ep << " differs from EP 1";
  }
}

// The E4M3 rows on the wire: every routed row the dispatch pulls (dispatch_fp8) is its token's
// quantization on the token's own rank (quantize_cpu of that token, byte for byte, scales too),
// at EP 1 and 2, with unused slots and T < T_max.
TEST(LayerForwardFp8, DispatchedRowsAreTheOwnersQuantization) {
  MOK_REQUIRE_HOPPER_GPUS(1);
  const Problem problem = fp8_problem({"skewed:2", 0.2, true, true}, 2 * 53, 51);
  const int64_t hidden = problem.shape.hidden, top_k = problem.shape.top_k;
  const int64_t num_scales = hidden / 128;
  const quantize::Layout all =
      quantize::describe(quantize::Format::kFp8, 1, problem.num_tokens, hidden, 1, 128, false);
  std::vector<uint8_t> expected_data(static_cast<size_t>(all.num_elements()));
  std::vector<float> expected_scales(static_cast<size_t>(all.num_scales()));
  quantize::quantize_cpu(all, problem.x.data(), quantize::InputType::kBf16, expected_data.data(),
                         expected_scales.data());
  for (int ep : {1, 2}) {
    SCOPED_TRACE("EP " + std::to_string(ep));
    const std::vector<Communicator>& comms = test_communicators(ep);
    const int64_t tokens = problem.num_tokens / ep, tokens_max = tokens + 3;
    for_each_rank(ep, [&](int rank) {
      MOK_CUDA_CHECK(cudaSetDevice(comms[rank].device()));
      const reference::RankInputs inputs = problem.rank_inputs(rank, ep);
      CommWorkspace ws(comms[rank], problem.shape, tokens_max);
      const int64_t capacity = ws.layout().rows_capacity();
      const int64_t experts_local = ws.layout().experts_per_rank();
      DeviceBuffer<bf16> x(host_vector(inputs.tokens.x));
      DeviceBuffer<int32_t> topk_idx(host_vector(inputs.tokens.topk_idx));
      DeviceBuffer<uint8_t> data(static_cast<size_t>(tokens * hidden));
      DeviceBuffer<float> scales(static_cast<size_t>(tokens * num_scales));
      DeviceBuffer<uint8_t> rows(static_cast<size_t>(capacity * hidden));
      DeviceBuffer<float> row_scales(static_cast<size_t>(capacity * num_scales));
      // Each emulated rank on its own non-blocking stream: on the legacy default stream the
      // ranks' kernels would queue behind each other while each waits for the other's flags.
      cudaStream_t stream = nullptr;
      MOK_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
      MOK_CUDA_CHECK(cudaMemsetAsync(rows.get(), 0xff, rows.bytes(), stream));
      MOK_CUDA_CHECK(cudaMemsetAsync(row_scales.get(), 0xff, row_scales.bytes(), stream));
      quantize::quantize_gpu(
          quantize::describe(quantize::Format::kFp8, 1, tokens, hidden, 1, 128, false), x.get(),
          quantize::InputType::kBf16, data.get(), scales.get(), stream);
      stage_fp8_tokens(ws, data.get(), scales.get(), tokens, stream);
      schedule(ws, topk_idx.get(), tokens, stream);
      dispatch_fp8(ws, {3, 96}, stream, rows.get(), row_scales.get());  // a few warps, many rows
      ws.check(stream);
      MOK_CUDA_CHECK(cudaStreamDestroy(stream));
      std::vector<int32_t> offsets(static_cast<size_t>(experts_local + 1));
      std::vector<int32_t> row_source(static_cast<size_t>(capacity));
      MOK_CUDA_CHECK(cudaMemcpy(offsets.data(), ws.expert_offsets(), offsets.size() * 4,
                                cudaMemcpyDeviceToHost));
      MOK_CUDA_CHECK(cudaMemcpy(row_source.data(), ws.row_source(), row_source.size() * 4,
                                cudaMemcpyDeviceToHost));
      const std::vector<uint8_t> got = rows.download();
      const std::vector<float> got_scales = row_scales.download();
      int64_t compared = 0;
      for (int64_t row = 0; row < offsets[experts_local]; ++row) {
        const int32_t packed = row_source[row];
        if (packed < 0) continue;
        const int64_t source = packed / top_k / tokens_max, token = packed / top_k % tokens_max;
        const int64_t global = source * tokens + token;
        ASSERT_EQ(0, std::memcmp(&got[row * hidden], &expected_data[global * hidden], hidden))
            << "rank " << rank << " row " << row << " (token " << global << "): E4M3 bytes";
        ASSERT_EQ(0, std::memcmp(&got_scales[row * num_scales],
                                 &expected_scales[global * num_scales], num_scales * 4))
            << "rank " << rank << " row " << row << " (token " << global << "): scales";
        ++compared;
      }
      EXPECT_GT(compared, 0) << "rank " << rank << " received no row";
    });
  }
}

TEST(LayerForwardFp8, RefusesToRunWithoutWeightsAndBadShapes) {
  MOK_REQUIRE_HOPPER_GPUS(1);
  const LayerShape shape{256, 256, 128, 16, 4};
  LayerForwardFp8 layer(local_communicators(1)[0], shape, 8);
  try {
    layer.forward(nullptr, nullptr, nullptr, nullptr, 0, nullptr);
    FAIL() << "a forward before quantize_weights was accepted";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("quantize_weights"), std::string::npos)
        << error.what();
  }
  try {
    LayerForwardFp8 odd(local_communicators(1)[0], LayerShape{256, 192, 0, 16, 4}, 8);
    FAIL() << "I = 192 accepted in fp8";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("intermediate"), std::string::npos) << error.what();
  }
}

}  // namespace
}  // namespace mok::comm_test
