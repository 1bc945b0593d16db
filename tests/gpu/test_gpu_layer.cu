// mok::GpuLayer, the public door to the GPU layer: forward and backward on its own weights match
// the CPU reference within tolerance (y, dx, d_topk_w), repeat bitwise, enqueue the launches the
// docs name, and a bad call names its argument.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "layer_test_support.cuh"
#include "mok/gpu_layer.hpp"
#include "mok/layer_runner.hpp"

namespace mok::comm_test {
namespace {

// The problem's weights into the layer's, in the engine's layouts.
void upload_weights(const Problem& problem, const GpuLayer& layer) {
  const LayerShape& shape = problem.shape;
  const GpuLayerWeights& weights = layer.weights();
  const int hidden = static_cast<int>(shape.hidden);
  const auto upload = [](bf16* device, const std::vector<bf16>& host) {
    MOK_CUDA_CHECK(cudaMemcpy(device, host.data(), host.size() * 2, cudaMemcpyHostToDevice));
  };
  upload(weights.gate_up,
         gemm::interleave_gate_up(problem.gate, problem.up, static_cast<int>(shape.num_experts),
                                  static_cast<int>(shape.intermediate), hidden));
  upload(weights.down, problem.down);
  if (shape.has_shared()) {
    upload(weights.shared_gate_up,
           gemm::interleave_gate_up(problem.shared_gate, problem.shared_up, 1,
                                    static_cast<int>(shape.shared_intermediate), hidden));
    upload(weights.shared_down, problem.shared_down);
  }
}

TEST(GpuLayer, ForwardAndBackwardMatchTheReferenceAndRepeat) {
  MOK_REQUIRE_HOPPER_GPUS(1);
  const Problem problem = layer_problem({"skewed:1.2", 0.1, true, true}, 257, 3);
  const LayerShape& shape = problem.shape;
  const int64_t tokens = problem.num_tokens, hidden = shape.hidden, top_k = shape.top_k;
  GpuLayer layer(0, shape, tokens);
  const GpuLayerWeights& weights = layer.weights();
  upload_weights(problem, layer);
  DeviceBuffer<bf16> x(problem.x), dy(problem.dy), y(tokens * hidden), dx(tokens * hidden);
  DeviceBuffer<int32_t> topk_idx(problem.topk_idx);
  DeviceBuffer<float> topk_w(problem.topk_w), d_topk_w(tokens * top_k);
  DeviceBuffer<float> grad_gate_up(weights.gate_up_elements), grad_down(weights.down_elements);
  DeviceBuffer<float> grad_shared_gate_up(weights.shared_gate_up_elements);
  DeviceBuffer<float> grad_shared_down(weights.shared_down_elements);
  const GpuLayerGradients grads{grad_gate_up.get(), grad_down.get(), grad_shared_gate_up.get(),
                                grad_shared_down.get(), gemm::WgradOutput::kFp32};
  auto step = [&] {
    y.poison();
    dx.poison();
    d_topk_w.poison();
    layer.forward(x.get(), topk_idx.get(), topk_w.get(), y.get(), tokens, nullptr);
    layer.backward(x.get(), topk_idx.get(), topk_w.get(), dy.get(), dx.get(), d_topk_w.get(), grads,
                   tokens, nullptr);
    layer.check(nullptr);
  };
  step();
  const std::vector<bf16> first_y = y.download(), first_dx = dx.download();
  const std::vector<float> first_d_topk_w = d_topk_w.download();
  expect_matches_reference(problem, 1, first_y);

  ProblemOutputs cpu = ProblemOutputs::poisoned(problem, 1);
  reference::backward(shape, problem.all_rank_inputs(1), cpu.rank_outputs(problem),
                      GradMode::kOverwrite);
  std::vector<double> expected_dx(cpu.dx.size()),
      expected_d_topk_w(cpu.d_topk_w.begin(), cpu.d_topk_w.end());
  for (size_t index = 0; index < cpu.dx.size(); ++index)
    expected_dx[index] = cpu.dx[index].to_float();
  EXPECT_TRUE(compare(first_dx, expected_dx).within(kBf16Tolerance))
      << compare(first_dx, expected_dx).describe();
  EXPECT_TRUE(compare(first_d_topk_w, expected_d_topk_w).within(kBf16Tolerance))
      << compare(first_d_topk_w, expected_d_topk_w).describe();

  step();
  EXPECT_EQ(first_difference(y.download(), first_y), -1) << "y differs on a repeat";
  EXPECT_EQ(first_difference(dx.download(), first_dx), -1) << "dx differs on a repeat";
  EXPECT_EQ(d_topk_w.download(), first_d_topk_w) << "d_topk_w differs on a repeat";
}

// What one call enqueues, counted in a captured graph (kernels, copies and fills): the fused
// forward's three launches, and the save-mode backward's ten at EP 1 without a shared expert
// (begin_call, the schedule with topk_w staged beside the ids, dy's rows, the down dgrad, the
// SwiGLU backward, the down wgrad, the gate/up dgrad, the reduce with d_topk_w, x's rows, the
// gate/up wgrad). A step that adds a launch fails here until the docs say so too.
TEST(GpuLayer, LaunchesOfTheForwardAndTheSaveModeBackward) {
  MOK_REQUIRE_HOPPER_GPUS(1);
  const LayerShape shape{256, 128, 0, 8, 2};
  const Problem problem = testing::make_problem({"uniform", 0.1, true, true}, 96, 7, shape);
  const int64_t tokens = problem.num_tokens;
  GpuLayer layer(0, shape, tokens);
  upload_weights(problem, layer);
  const GpuLayerWeights& weights = layer.weights();
  DeviceBuffer<bf16> x(problem.x), dy(problem.dy), y(tokens * shape.hidden);
  DeviceBuffer<bf16> dx(tokens * shape.hidden), saved(layer.saved_context_elements(tokens));
  DeviceBuffer<int32_t> topk_idx(problem.topk_idx);
  DeviceBuffer<float> topk_w(problem.topk_w), d_topk_w(tokens * shape.top_k);
  DeviceBuffer<bf16> grad_gate_up(weights.gate_up_elements), grad_down(weights.down_elements);
  const GpuLayerGradients grads{grad_gate_up.get(), grad_down.get(), nullptr, nullptr,
                                gemm::WgradOutput::kBf16};
  const GpuSavedContext context{saved.get(), nullptr};
  cudaStream_t stream = nullptr;
  MOK_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const auto forward = [&] {
    layer.forward(x.get(), topk_idx.get(), topk_w.get(), y.get(), tokens, stream, &context);
  };
  const auto backward = [&] {
    layer.backward(x.get(), topk_idx.get(), topk_w.get(), dy.get(), dx.get(), d_topk_w.get(), grads,
                   tokens, stream, &context);
  };
  forward();  // (eagerly first: whatever a first call sets up is not in the count)
  backward();
  layer.check(stream);
  const auto launches = [&](const auto& enqueue) {
    cudaGraph_t graph = nullptr;
    MOK_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeRelaxed));
    enqueue();
    MOK_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
    size_t count = 0;
    MOK_CUDA_CHECK(cudaGraphGetNodes(graph, nullptr, &count));
    std::vector<cudaGraphNode_t> nodes(count);
    MOK_CUDA_CHECK(cudaGraphGetNodes(graph, nodes.data(), &count));
    int enqueued = 0;
    for (cudaGraphNode_t node : nodes) {
      cudaGraphNodeType type{};
      MOK_CUDA_CHECK(cudaGraphNodeGetType(node, &type));
      enqueued += type == cudaGraphNodeTypeKernel || type == cudaGraphNodeTypeMemcpy ||
                  type == cudaGraphNodeTypeMemset;
    }
    MOK_CUDA_CHECK(cudaGraphDestroy(graph));
    return enqueued;
  };
  EXPECT_EQ(launches(forward), 3);
  EXPECT_EQ(launches(backward), 10);
  MOK_CUDA_CHECK(cudaStreamDestroy(stream));
}

TEST(GpuLayer, TooManyTokensNameTheArgument) {
  MOK_REQUIRE_HOPPER_GPUS(1);
  GpuLayer layer(0, find_preset("tiny").shape, 64);
  try {
    layer.forward(nullptr, nullptr, nullptr, nullptr, 65, nullptr);
    FAIL() << "65 tokens accepted with tokens_max 64";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("num_tokens"), std::string::npos) << error.what();
  }
}

// The fit check that bench_layer and `mok run --backend cuda` ask before a case: a small layer
// fits; a layer too large for the GPU is refused with the bytes it needs, and the fp8 layer run
// beside the bf16 one (its weight cache, buffers, gradients and context) needs more than the
// bf16 step alone.
TEST(GpuLayerFit, TheFp8StepCountsItsCacheAndBuffers) {
  MOK_REQUIRE_HOPPER_GPUS(1);
  EXPECT_EQ(gpu_layer_unfit_reason(find_preset("tiny").shape, 1, 256, true, true), "");
  const LayerShape shape = find_preset("deepseek-v3").shape;
  const int64_t tokens = 1 << 20;  // ~1M tokens a rank: beyond any Hopper GPU's memory
  const std::string bf16 = gpu_layer_unfit_reason(shape, 1, tokens, /*backward=*/true);
  const std::string fp8 = gpu_layer_unfit_reason(shape, 1, tokens, true, /*fp8=*/true);
  ASSERT_NE(bf16, "");
  ASSERT_NE(fp8, "");
  EXPECT_NE(fp8.find("fp8 beside bf16"), std::string::npos) << fp8;
  const auto needed_mib = [](const std::string& reason) {
    const size_t at = reason.find("needs about ");
    return at == std::string::npos ? -1 : std::stoll(reason.substr(at + 12));
  };
  EXPECT_GT(needed_mib(fp8), needed_mib(bf16)) << bf16 << " | " << fp8;
}

}  // namespace
}  // namespace mok::comm_test
