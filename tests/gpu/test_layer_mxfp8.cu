// The GPU layer in mxfp8 (LayerForwardMxfp8, LayerBackwardMxfp8: the numerics mode on the bf16
// engine) against the CPU reference's mxfp8 mode and the fp64 oracle: y, dx, d_topk_w and every
// routed and shared weight gradient within the FP8 yardstick's rule, on fresh random data into
// NaN-poisoned outputs; and the determinism contract bitwise: repeats, a replayed graph, GEMM and
// copy SM counts, save mode = recompute mode, EP 1 = 2 = 4 (emulated on one GPU where there is
// one).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "backward_test_support.cuh"
#include "mok/compare.hpp"
#include "mok/reference.hpp"
#include "runtime/layer_backward_mxfp8.hpp"
#include "runtime/layer_forward_mxfp8.hpp"
#include "runtime/mx_weights.hpp"

namespace mok::comm_test {
namespace {

// H 256 (eight mxfp8 blocks), I 160 (five: no multiple of 128), I_s 64, E 8, top-4; or I 96, top-2.
const LayerShape kTop4{256, 160, 64, 8, 4};
const LayerShape kTop2{256, 96, 64, 8, 2};

struct MxRun {
  LayerForwardOptions forward;  // the forward's (save mode: the backward's forward too)
  LayerBackwardOptions backward;
  int repeats = 1;  // runs after the first; each must give the first's bits
  bool use_graph = false;
  // Backward: LayerForwardMxfp8 keeps the context for it, their weight cache the forward's (with
  // the dgrad copy); otherwise the backward alone, recomputing, on an MxWeightCache of its own.
  bool save = false;
};

// y of all ranks from LayerForwardMxfp8: weights round-tripped once, y and the rows in between
// NaN-poisoned before each run, every run's y (and graph replay's) the first one's bits.
std::vector<bf16> run_mx_forward(const Problem& problem, int ep, const MxRun& run) {
  const std::vector<Communicator>& comms = test_communicators(ep);
  const int64_t tokens = problem.num_tokens / ep, hidden = problem.shape.hidden;
  std::vector<bf16> y_all(static_cast<size_t>(problem.num_tokens * hidden));
  for_each_rank(ep, [&](int rank) {
    MOK_CUDA_CHECK(cudaSetDevice(comms[rank].device()));
    const reference::RankInputs inputs = problem.rank_inputs(rank, ep);
    LayerForwardMxfp8 layer(comms[rank], problem.shape, tokens, {run.forward, false});
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

// The fp32 outputs of a backward: the GPU's, the CPU reference's and the oracle's, by name.
struct FloatOutput {
  const char* name;
  std::vector<float> BackwardOutputs::*gpu;
  std::vector<float> ProblemOutputs::*cpu;
  std::vector<double> reference::OracleResult::*oracle;
};
using B = BackwardOutputs;
using P = ProblemOutputs;
using R = reference::OracleResult;
const FloatOutput kFloatOutputs[] = {
    {"d_topk_w", &B::d_topk_w, &P::d_topk_w, &R::d_topk_w},
    {"grad_gate", &B::grad_gate, &P::grad_gate, &R::grad_gate},
    {"grad_up", &B::grad_up, &P::grad_up, &R::grad_up},
    {"grad_down", &B::grad_down, &P::grad_down, &R::grad_down},
    {"grad_shared_gate", &B::grad_shared_gate, &P::grad_shared_gate, &R::grad_shared_gate},
    {"grad_shared_up", &B::grad_shared_up, &P::grad_shared_up, &R::grad_shared_up},
    {"grad_shared_down", &B::grad_shared_down, &P::grad_shared_down, &R::grad_shared_down},
};

// The first output whose bits differ, by name (the shared expert's gradients too); "" if none.
std::string differing_output(const BackwardOutputs& a, const BackwardOutputs& b) {
  if (a.dx.size() != b.dx.size() || first_difference(a.dx, b.dx) >= 0) return "dx";
  for (const FloatOutput& output : kFloatOutputs) {
    if (!same_bits(a.*output.gpu, b.*output.gpu)) return output.name;
  }
  return "";
}

// Every output of LayerBackwardMxfp8 on all ranks, in global layout: outputs (and the workspace's
// rows, and a save mode's context) NaN-poisoned before each run, every repeat and graph replay the
// first run's bits.
BackwardOutputs run_mx_backward(const Problem& problem, int ep, const MxRun& run) {
  const std::vector<Communicator>& comms = test_communicators(ep);
  const LayerShape& shape = problem.shape;
  const int64_t tokens = problem.num_tokens / ep, hidden = shape.hidden;
  const int64_t inter = shape.intermediate, shared_inter = shape.shared_intermediate;
  const int64_t local_experts = shape.num_experts / ep;
  const bool shared = shape.has_shared();
  std::vector<BackwardOutputs> per_rank(ep);
  for_each_rank(ep, [&](int rank) {
    MOK_CUDA_CHECK(cudaSetDevice(comms[rank].device()));
    const reference::RankInputs inputs = problem.rank_inputs(rank, ep);
    const RankDeviceWeights device_weights(inputs.weights, shape);
    DeviceBuffer<bf16> x(host_vector(inputs.tokens.x)), dy(host_vector(inputs.dy));
    DeviceBuffer<int32_t> topk_idx(host_vector(inputs.tokens.topk_idx));
    DeviceBuffer<float> topk_w(host_vector(inputs.tokens.topk_w));
    DeviceBuffer<bf16> dx(static_cast<size_t>(tokens * hidden));
    DeviceBuffer<float> d_topk_w(static_cast<size_t>(tokens * shape.top_k));
    DeviceBuffer<float> grad_gate_up(device_weights.gate_up.size()),
        grad_down(device_weights.down.size()),
        grad_shared_gate_up(device_weights.shared_gate_up.size()),
        grad_shared_down(device_weights.shared_down.size());
    const DeviceLayerGradients grads{
        grad_gate_up.get(), grad_down.get(), shared ? grad_shared_gate_up.get() : nullptr,
        shared ? grad_shared_down.get() : nullptr, gemm::WgradOutput::kFp32};
    cudaStream_t stream = nullptr;
    MOK_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    LayerBackwardMxfp8 layer(comms[rank], shape, tokens, run.backward);
    std::unique_ptr<LayerForwardMxfp8> forward;
    std::unique_ptr<MxWeightCache> own_cache;
    if (run.save) {
      forward = std::make_unique<LayerForwardMxfp8>(
          comms[rank], shape, tokens, LayerForwardMxfp8Options{run.forward, /*dgrad=*/true});
      forward->quantize_weights(device_weights.view(), stream);
    } else {
      own_cache = std::make_unique<MxWeightCache>(shape, local_experts, /*dgrad=*/true);
      own_cache->quantize(device_weights.view(), stream);
    }
    MOK_CUDA_CHECK(cudaStreamSynchronize(stream));
    const MxWeightCache& cache = forward != nullptr ? forward->weight_cache() : *own_cache;
    CommWorkspace& ws = layer.workspace();
    const RegisteredWorkspace registered(rank, "backward", ws);  // (for a timeout's report)
    const int64_t save_tokens = run.save ? tokens : 0;
    DeviceBuffer<bf16> y(static_cast<size_t>(save_tokens * hidden));
    DeviceBuffer<bf16> saved_gate_up(static_cast<size_t>(
        saved_context_rows(ep, save_tokens, shape.top_k, save_tokens) * 2 * inter));
    DeviceBuffer<bf16> saved_shared_gate_up(
        static_cast<size_t>(shared ? save_tokens * 2 * shared_inter : 0));
    const SavedContext saved{saved_gate_up.get(), shared ? saved_shared_gate_up.get() : nullptr};
    auto prepare = [&] {
      for (DeviceBuffer<float>* output :
           {&d_topk_w, &grad_gate_up, &grad_down, &grad_shared_gate_up, &grad_shared_down}) {
        output->poison();
      }
      dx.poison();
      const size_t row_bytes = static_cast<size_t>(ws.layout().row_bytes());
      MOK_CUDA_CHECK(cudaMemset(ws.expert_y(), 0xff, ws.layout().expert_y_rows * row_bytes));
      MOK_CUDA_CHECK(cudaMemset(ws.expert_x(), 0xff, ws.layout().expert_rows * row_bytes));
      MOK_CUDA_CHECK(cudaMemset(ws.expert_dy(), 0xff, ws.layout().rows_capacity() * row_bytes));
      MOK_CUDA_CHECK(cudaMemset(ws.slots(), 0xff, ws.layout().slot_rows * row_bytes));
      MOK_CUDA_CHECK(
          cudaMemset(ws.d_topk_w(), 0xff, ws.layout().tokens_max * ws.layout().top_k * 4));
      saved_gate_up.poison();
      saved_shared_gate_up.poison();
      MOK_CUDA_CHECK(cudaDeviceSynchronize());
      // Ranks emulated on one GPU: none enqueues while another still synchronises the device.
      comms[rank].host_barrier();
    };
    auto enqueue = [&] {
      if (forward != nullptr) {
        forward->forward(x.get(), topk_idx.get(), topk_w.get(), y.get(), tokens, stream, nullptr,
                         &saved);
      }
      layer.backward(cache, x.get(), topk_idx.get(), topk_w.get(), dy.get(), dx.get(),
                     d_topk_w.get(), grads, tokens, stream, nullptr, run.save ? &saved : nullptr);
    };
    const auto check = [&] {
      if (forward != nullptr) forward->check(stream);
      layer.check(stream);
    };
    auto collect = [&] {
      BackwardOutputs out;
      out.dx = dx.download();
      out.d_topk_w = d_topk_w.download();
      gemm::split_gate_up(grad_gate_up.download(), local_experts, inter, hidden, out.grad_gate,
                          out.grad_up);
      out.grad_down = grad_down.download();
      if (shared) {
        gemm::split_gate_up(grad_shared_gate_up.download(), 1, shared_inter, hidden,
                            out.grad_shared_gate, out.grad_shared_up);
        out.grad_shared_down = grad_shared_down.download();
      }
      return out;
    };
    const auto expect_first = [&](const BackwardOutputs& first, const char* what, int index) {
      const std::string differs = differing_output(collect(), first);
      MOK_CHECK_ARG(differs.empty(), what, "rank ", rank, " run ", index, ": ", differs,
                    " differs from the first run");
    };
    prepare();
    run_and_check([] {}, enqueue, check);
    const BackwardOutputs first = collect();
    for (int repeat = 0; repeat < run.repeats; ++repeat) {
      prepare();
      run_and_check([] {}, enqueue, check);
      expect_first(first, "repeat", repeat);
    }
    if (run.use_graph) {
      replay_in_graph(stream, enqueue, 2, prepare, [&](int replay) {
        check();
        expect_first(first, "graph replay", replay);
      });
    }
    MOK_CUDA_CHECK(cudaStreamDestroy(stream));
    per_rank[rank] = first;
  });
  BackwardOutputs all;  // global layout: tokens and experts in rank order
  for (const BackwardOutputs& rank : per_rank) {
    all.dx.insert(all.dx.end(), rank.dx.begin(), rank.dx.end());
    for (const FloatOutput& output : kFloatOutputs) {
      std::vector<float>& to = all.*output.gpu;
      to.insert(to.end(), (rank.*output.gpu).begin(), (rank.*output.gpu).end());
    }
  }
  return all;
}

reference::Options mxfp8_options() {
  reference::Options options;
  options.precision = Precision::kMxfp8;
  return options;
}

template <class Value>
std::vector<double> as_doubles(const std::vector<Value>& values) {
  std::vector<double> out;
  for (const Value value : values) out.push_back(static_cast<float>(value));
  return out;
}

// The FP8 rule the fp8 layer tests apply (mok/compare.hpp): an output's relative L2 error against
// the fp64 oracle of the bf16 inputs within kFp8YardstickTolerance (5 %) of the yardstick's — the
// same mxfp8 operands with everything else in fp64 (reference::oracle in Precision::kMxfp8): what
// the recipe itself costs. The CPU reference in mxfp8 meets the same rule here. And the GPU, whose
// GEMM operands are the reference's dequantized values (only the order of the fp32 sums differs,
// which moves an E4M3 or bf16 rounding now and then), is within 2 % of the CPU reference, the
// fp8 layer tests' bound.
constexpr double kGpuVsCpuTolerance = 0.02;

template <class Value>
void expect_mxfp8_rule(const char* name, const std::vector<Value>& gpu,
                       const std::vector<Value>& cpu, const std::vector<double>& exact,
                       const std::vector<double>& yardstick) {
  SCOPED_TRACE(name);
  ASSERT_EQ(gpu.size(), exact.size());
  const ErrorStats gpu_error = compare(gpu, exact);
  const ErrorStats cpu_error = compare(cpu, exact);
  const double yardstick_error = compare(yardstick, exact).relative_l2;
  const ErrorStats gpu_vs_cpu = compare(gpu, as_doubles(cpu));
  std::cout << "[ accuracy ] mxfp8 " << name << " vs fp64: GPU " << gpu_error.relative_l2
            << ", CPU reference " << cpu_error.relative_l2 << ", quantized operands in fp64 "
            << yardstick_error << "; GPU vs CPU reference " << gpu_vs_cpu.relative_l2 << "\n";
  EXPECT_EQ(gpu_error.non_finite, 0) << "unwritten (NaN) elements";
  EXPECT_LE(std::fabs(gpu_error.relative_l2 - yardstick_error),
            kFp8YardstickTolerance * yardstick_error)
      << "GPU: " << gpu_error.describe() << "; yardstick " << yardstick_error;
  EXPECT_LE(std::fabs(cpu_error.relative_l2 - yardstick_error),
            kFp8YardstickTolerance * yardstick_error)
      << "CPU reference: " << cpu_error.describe() << "; yardstick " << yardstick_error;
  EXPECT_GT(yardstick_error, 0x1p-7) << "no quantization error at all?";
  EXPECT_TRUE(gpu_vs_cpu.within(kGpuVsCpuTolerance))
      << "GPU vs the CPU mxfp8 reference: " << gpu_vs_cpu.describe();
}

void expect_forward_accuracy(const Problem& problem, const std::vector<bf16>& y) {
  const std::vector<reference::RankInputs> ranks = problem.all_rank_inputs(1);
  ProblemOutputs cpu = ProblemOutputs::poisoned(problem, 1);
  reference::forward(problem.shape, ranks, cpu.rank_outputs(problem), mxfp8_options());
  expect_mxfp8_rule("y", y, cpu.y, reference::oracle(problem.shape, ranks, false)[0].y,
                    reference::oracle(problem.shape, ranks, false, mxfp8_options())[0].y);
}

void expect_backward_accuracy(const Problem& problem, const BackwardOutputs& gpu) {
  const std::vector<reference::RankInputs> ranks = problem.all_rank_inputs(1);
  ProblemOutputs cpu = ProblemOutputs::poisoned(problem, 1);
  reference::backward(problem.shape, ranks, cpu.rank_outputs(problem), GradMode::kOverwrite,
                      mxfp8_options());
  const reference::OracleResult exact = reference::oracle(problem.shape, ranks, true)[0];
  const reference::OracleResult yardstick =
      reference::oracle(problem.shape, ranks, true, mxfp8_options())[0];
  expect_mxfp8_rule("dx", gpu.dx, cpu.dx, exact.dx, yardstick.dx);
  for (const FloatOutput& output : kFloatOutputs) {
    if ((exact.*output.oracle).empty()) continue;  // (no shared expert)
    expect_mxfp8_rule(output.name, gpu.*output.gpu, cpu.*output.cpu, exact.*output.oracle,
                      yardstick.*output.oracle);
  }
}

// Every output written (no poison left) and the unused slots' d_topk_w zero.
void expect_all_written(const Problem& problem, const BackwardOutputs& gpu) {
  for (const bf16 value : gpu.dx) ASSERT_TRUE(std::isfinite(value.to_float())) << "dx";
  for (const FloatOutput& output : kFloatOutputs) {
    for (const float value : gpu.*output.gpu) ASSERT_TRUE(std::isfinite(value)) << output.name;
  }
  for (size_t slot = 0; slot < gpu.d_topk_w.size(); ++slot) {
    if (problem.topk_idx[slot] < 0) ASSERT_EQ(gpu.d_topk_w[slot], 0.0f) << "unused slot " << slot;
  }
}

struct MxCase {
  Case routing;
  LayerShape shape;
};

void PrintTo(const MxCase& which, std::ostream* out) {
  testing::PrintTo(which.routing, out);
  *out << ", " << which.shape.describe();
}

class LayerMxfp8Routings : public ::testing::TestWithParam<MxCase> {};

TEST_P(LayerMxfp8Routings, MatchesTheReferenceRuleAndRepeatsBitwise) {
  MOK_REQUIRE_HOPPER_GPUS(1);
  MxRun run;
  run.repeats = 2;
  const Problem problem = testing::make_problem(GetParam().routing, 301, 71, GetParam().shape);
  expect_forward_accuracy(problem, run_mx_forward(problem, 1, run));
  const BackwardOutputs gpu = run_mx_backward(problem, 1, run);
  expect_all_written(problem, gpu);
  expect_backward_accuracy(problem, gpu);
  // One token: too few values for relative errors to mean much; every output still written.
  const Problem one = testing::make_problem(GetParam().routing, 1, 73, GetParam().shape);
  for (const bf16 value : run_mx_forward(one, 1, run)) ASSERT_TRUE(std::isfinite(value.to_float()));
  expect_all_written(one, run_mx_backward(one, 1, run));
}

// skewed:4 without a shared expert; unused slots in two cases.
INSTANTIATE_TEST_SUITE_P(Routings, LayerMxfp8Routings,
                         ::testing::Values(MxCase{{"uniform", 0.1, true, true}, kTop4},
                                           MxCase{{"skewed:4", 0.0, false, false}, kTop4},
                                           MxCase{{"skewed:2", 0.2, true, true}, kTop2},
                                           MxCase{{"single-expert", 0.0, true, true}, kTop2}),
                         [](const auto& info) {
                           return case_name(info.param.routing) + "_top" +
                                  std::to_string(info.param.shape.top_k);
                         });

// The same bits under every GEMM and copy grid, with and without the shared expert beside the
// dispatch, from a replayed graph, and at EP 2 and 4.
std::vector<MxRun> knob_settings() {
  std::vector<MxRun> knobs(3);
  knobs[0].forward.gemm.num_sms = knobs[0].backward.gemm.num_sms = 37;
  knobs[0].forward.copy = knobs[0].backward.copy = {5, 256};
  knobs[1].forward.gemm.num_sms = knobs[1].backward.gemm.num_sms = 8;
  knobs[1].forward.overlap_shared_with_dispatch = false;
  knobs[1].backward.overlap_shared_with_dispatch = false;
  knobs[1].backward.local_dispatch_on_every_sm = false;
  knobs[2].forward.copy = knobs[2].backward.copy = {64, 512};
  return knobs;
}

TEST(LayerMxfp8, ForwardKnobsGraphAndEpDoNotChangeABit) {
  MOK_REQUIRE_HOPPER_GPUS(1);
  const Problem problem = testing::make_problem({"skewed:1.2", 0.1, true, true}, 4 * 71, 79, kTop4);
  MxRun run;
  run.use_graph = true;
  const std::vector<bf16> expected = run_mx_forward(problem, 1, run);
  expect_forward_accuracy(problem, expected);
  const std::vector<MxRun> knobs = knob_settings();
  for (size_t index = 0; index < knobs.size(); ++index) {
    EXPECT_EQ(first_difference(run_mx_forward(problem, 1, knobs[index]), expected), -1)
        << "knob setting " << index;
  }
  for (int ep : {2, 4}) {
    EXPECT_EQ(first_difference(run_mx_forward(problem, ep, MxRun{}), expected), -1)
        << "EP " << ep << " differs from EP 1";
  }
}

TEST(LayerMxfp8, BackwardKnobsGraphAndEpDoNotChangeABit) {
  MOK_REQUIRE_HOPPER_GPUS(1);
  const Problem problem = testing::make_problem({"skewed:1.2", 0.1, true, true}, 4 * 71, 83, kTop4);
  MxRun run;
  run.use_graph = true;  // run_mx_backward throws if a replay differs from the eager run
  const BackwardOutputs expected = run_mx_backward(problem, 1, run);
  expect_backward_accuracy(problem, expected);
  const std::vector<MxRun> knobs = knob_settings();
  for (size_t index = 0; index < knobs.size(); ++index) {
    EXPECT_EQ(differing_output(run_mx_backward(problem, 1, knobs[index]), expected), "")
        << "knob setting " << index;
  }
  // The EP contract covers dx, d_topk_w and the routed gradients: each rank's shared expert sums
  // over that rank's own tokens, its 32 x 1 blocks from the rank's first token (the reference's
  // weight_grads), so its gradients are another sum at each EP degree.
  for (int ep : {2, 4}) {
    EXPECT_EQ(first_different_tensor(run_mx_backward(problem, ep, MxRun{}), expected), "")
        << "EP " << ep << " differs from EP 1";
  }
}

// Save mode (LayerForwardMxfp8 keeps the gate/up sums rounded to bf16, the backward reads them)
// gives the recompute's bits in every output, shared expert included, at EP 1 and 2, with a
// repeat (each run's forward writes the poisoned context again).
TEST(LayerMxfp8, SaveModeGivesRecomputesBits) {
  MOK_REQUIRE_HOPPER_GPUS(1);
  for (const MxCase& which : {MxCase{{"skewed:1.2", 0.1, true, true}, kTop4},
                              MxCase{{"uniform", 0.0, false, false}, kTop2}}) {
    SCOPED_TRACE(case_name(which.routing));
    const Problem problem = testing::make_problem(which.routing, 2 * 97, 89, which.shape);
    MxRun save;
    save.save = true;
    for (int ep : {1, 2}) {
      EXPECT_EQ(differing_output(run_mx_backward(problem, ep, save),
                                 run_mx_backward(problem, ep, MxRun{})),
                "")
          << "EP " << ep << ": save mode differs from recompute mode";
    }
  }
}

TEST(LayerMxfp8, RefusesToRunWithoutTheWeightsItReads) {
  MOK_REQUIRE_HOPPER_GPUS(1);
  const Communicator& comm = local_communicators(1)[0];
  const auto argument_of = [](auto&& call) {
    try {
      call();
    } catch (const Error& error) {
      return error.argument();
    }
    return std::string("no error");
  };
  LayerForwardMxfp8 forward(comm, kTop2, 8);
  EXPECT_EQ(argument_of([&] { forward.forward(nullptr, nullptr, nullptr, nullptr, 0, nullptr); }),
            "weights")
      << "a forward before quantize_weights";
  const Problem problem = testing::make_problem({"uniform", 0.0, false, true}, 8, 3, kTop2);
  const RankDeviceWeights weights(problem.rank_inputs(0, 1).weights, kTop2);
  LayerBackwardMxfp8 backward(comm, kTop2, 8);
  MxWeightCache empty(kTop2, kTop2.num_experts, true);
  MxWeightCache forward_only(kTop2, kTop2.num_experts, false);
  forward_only.quantize(weights.view(), nullptr);
  // Another layer's weights: kTop4's I, its cache quantized from weights of that size.
  const Problem other = testing::make_problem({"uniform", 0.0, false, true}, 8, 3, kTop4);
  const RankDeviceWeights other_weights(other.rank_inputs(0, 1).weights, kTop4);
  MxWeightCache other_shape(kTop4, kTop4.num_experts, true);
  other_shape.quantize(other_weights.view(), nullptr);
  MOK_CUDA_CHECK(cudaDeviceSynchronize());
  for (const MxWeightCache* cache : {&empty, &forward_only, &other_shape}) {
    EXPECT_EQ(argument_of([&] {
                backward.backward(*cache, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, {},
                                  0, nullptr);
              }),
              "weights")
        << "a cache the backward cannot read";
  }
}

}  // namespace
}  // namespace mok::comm_test
