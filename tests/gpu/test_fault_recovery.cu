// Device-side fault handling on one GPU, in a run of training steps (the fused forward,
// LayerForward, then LayerBackward): a routing poisoned in the middle of the run — an expert id
// out of range, written into topk_idx on the stream as a faulty router would — is recorded on the
// device by both layers (each makes its own schedule) and named, token and slot, at the next
// check; it stays reported until reset_after_error; after the reset the run goes on, and every
// following step gives bitwise the outputs of a pair of layers that never saw the fault (a second
// fault later in the run is named by its own token and slot, not the first's).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "layer_test_support.cuh"
#include "runtime/layer_backward.hpp"

namespace mok::comm_test {
namespace {

// Every output of one training step.
struct StepOutputs {
  std::vector<bf16> y, dx;
  std::vector<float> d_topk_w, grad_gate_up, grad_down, grad_shared_gate_up, grad_shared_down;
};

template <class T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

// The first output whose bits differ, by name; empty when all match.
std::string first_different_output(const StepOutputs& a, const StepOutputs& b) {
  if (!same_bits(a.y, b.y)) return "y";
  if (!same_bits(a.dx, b.dx)) return "dx";
  if (!same_bits(a.d_topk_w, b.d_topk_w)) return "d_topk_w";
  if (!same_bits(a.grad_gate_up, b.grad_gate_up)) return "grad_gate_up";
  if (!same_bits(a.grad_down, b.grad_down)) return "grad_down";
  if (!same_bits(a.grad_shared_gate_up, b.grad_shared_gate_up)) return "grad_shared_gate_up";
  if (!same_bits(a.grad_shared_down, b.grad_shared_down)) return "grad_shared_down";
  return "";
}

// The first output holding a NaN or infinity (every output is poisoned before a step: an element
// the step did not write is NaN); empty when none does.
std::string first_unwritten_output(const StepOutputs& outputs) {
  auto bf16_finite = [](const std::vector<bf16>& values) {
    for (const bf16 value : values) {
      if ((value.bits & 0x7f80u) == 0x7f80u) return false;
    }
    return true;
  };
  auto float_finite = [](const std::vector<float>& values) {
    for (const float value : values) {
      if (!std::isfinite(value)) return false;
    }
    return true;
  };
  if (!bf16_finite(outputs.y)) return "y";
  if (!bf16_finite(outputs.dx)) return "dx";
  if (!float_finite(outputs.d_topk_w)) return "d_topk_w";
  if (!float_finite(outputs.grad_gate_up)) return "grad_gate_up";
  if (!float_finite(outputs.grad_down)) return "grad_down";
  if (!float_finite(outputs.grad_shared_gate_up)) return "grad_shared_gate_up";
  if (!float_finite(outputs.grad_shared_down)) return "grad_shared_down";
  return "";
}

// One step's inputs: the run's x and dy, a routing of its own.
struct Step {
  Case routing;
  uint64_t seed;
  // A poisoned step: topk_idx[token][slot] = id (out of range) once the routing is on the device.
  bool poisoned = false;
  int32_t id = 0;
  int64_t token = 0;
  int slot = 0;
};

// A forward and a backward layer with the problem's weights, and the backward's gradients.
class LayerPair {
 public:
  LayerPair(const Problem& problem, int64_t tokens)
      : forward_(local_communicators(1)[0], problem.shape, tokens, forward_options()),
        backward_(local_communicators(1)[0], problem.shape, tokens, backward_options()),
        grad_gate_up_(weights().gate_up_elements),
        grad_down_(weights().down_elements),
        grad_shared_gate_up_(weights().shared_gate_up_elements),
        grad_shared_down_(weights().shared_down_elements) {
    forward_.load_weights(problem.rank_inputs(0, 1).weights);
  }

  // Enqueues the forward and the backward of one step on `stream`, every output poisoned first.
  void enqueue(const bf16* x, const int32_t* topk_idx, const float* topk_w, const bf16* dy,
               DeviceBuffer<bf16>& y, DeviceBuffer<bf16>& dx, DeviceBuffer<float>& d_topk_w,
               int64_t tokens, cudaStream_t stream) {
    const bool shared = forward_.shape().has_shared();
    MOK_CUDA_CHECK(cudaMemsetAsync(y.get(), 0xff, y.size() * sizeof(bf16), stream));
    MOK_CUDA_CHECK(cudaMemsetAsync(dx.get(), 0xff, dx.size() * sizeof(bf16), stream));
    MOK_CUDA_CHECK(cudaMemsetAsync(d_topk_w.get(), 0xff, d_topk_w.size() * sizeof(float), stream));
    for (DeviceBuffer<float>* grad :
         {&grad_gate_up_, &grad_down_, &grad_shared_gate_up_, &grad_shared_down_}) {
      MOK_CUDA_CHECK(cudaMemsetAsync(grad->get(), 0xff, grad->size() * sizeof(float), stream));
    }
    forward_.forward(x, topk_idx, topk_w, y.get(), tokens, stream);
    const DeviceLayerGradients grads{
        grad_gate_up_.get(), grad_down_.get(), shared ? grad_shared_gate_up_.get() : nullptr,
        shared ? grad_shared_down_.get() : nullptr, gemm::WgradOutput::kFp32};
    backward_.backward(weights(), x, topk_idx, topk_w, dy, dx.get(), d_topk_w.get(), grads, tokens,
                       stream);
  }

  StepOutputs outputs(const DeviceBuffer<bf16>& y, const DeviceBuffer<bf16>& dx,
                      const DeviceBuffer<float>& d_topk_w) const {
    StepOutputs out{y.download(),
                    dx.download(),
                    d_topk_w.download(),
                    grad_gate_up_.download(),
                    grad_down_.download(),
                    {},
                    {}};
    if (forward_.shape().has_shared()) {
      out.grad_shared_gate_up = grad_shared_gate_up_.download();
      out.grad_shared_down = grad_shared_down_.download();
    }
    return out;
  }

  LayerForward& forward() { return forward_; }
  LayerBackward& backward() { return backward_; }

 private:
  static LayerForwardOptions forward_options() {
    LayerForwardOptions options;
    options.fused.enabled = true;
    options.workspace.timeout_ms = 2000;  // a wait that the fault left hanging ends quickly
    return options;
  }
  static LayerBackwardOptions backward_options() {
    LayerBackwardOptions options;
    options.workspace.timeout_ms = 2000;
    return options;
  }
  const DeviceLayerWeights& weights() const { return forward_.device_weights(); }

  LayerForward forward_;
  LayerBackward backward_;
  DeviceBuffer<float> grad_gate_up_, grad_down_, grad_shared_gate_up_, grad_shared_down_;
};

// Runs `check`, which must throw mok::Error about topk_idx with `fragment` in its message.
void expect_named_fault(const std::function<void()>& check, const std::string& fragment,
                        const std::string& who) {
  try {
    check();
    ADD_FAILURE() << who << ": no error; expected one with '" << fragment << "'";
  } catch (const Error& error) {
    const std::string message = error.what();
    EXPECT_EQ(error.argument(), "topk_idx") << who << ": " << message;
    EXPECT_NE(message.find(fragment), std::string::npos) << who << ": " << message;
  }
}

TEST(FaultRecovery, PoisonedRoutingIsNamedThenTheRunGoesOnBitwiseAsIfItNeverHappened) {
  MOK_REQUIRE_HOPPER_GPUS(1);
  const int64_t tokens = 300;  // not a multiple of 128
  // H 512, I 192, I_s 64, E 16, top-6: several K blocks and N tiles, a partial N tile.
  const Problem problem = layer_problem({"uniform", 0.1, true, true}, tokens, 17, true);
  const LayerShape& shape = problem.shape;
  const int32_t experts = static_cast<int32_t>(shape.num_experts);
  const std::vector<Step> steps = {
      {{"uniform", 0.1, true, true}, 101},
      {{"skewed:4", 0.0, true, true}, 102},
      {{"single-expert", 0.0, true, true}, 103},
      {{"uniform", 0.2, true, true}, 104, true, experts + 5, 37, 2},  // above the range
      {{"uniform", 0.0, true, true}, 105},
      {{"skewed:1.2", 0.3, true, true}, 106},
      {{"uniform", 0.0, true, true}, 107, true, -2, 5, 0},  // below the range (-1 is unused)
      {{"skewed:4", 0.1, true, true}, 108},
  };

  const Communicator& comm = local_communicators(1)[0];
  MOK_CUDA_CHECK(cudaSetDevice(comm.device()));
  LayerPair faulted(problem, tokens), clean(problem, tokens);
  DeviceBuffer<bf16> x(problem.x), dy(problem.dy);
  DeviceBuffer<int32_t> topk_idx(static_cast<size_t>(tokens * shape.top_k));
  DeviceBuffer<float> topk_w(static_cast<size_t>(tokens * shape.top_k));
  DeviceBuffer<bf16> y(static_cast<size_t>(tokens * shape.hidden));
  DeviceBuffer<bf16> dx(static_cast<size_t>(tokens * shape.hidden));
  DeviceBuffer<float> d_topk_w(static_cast<size_t>(tokens * shape.top_k));
  cudaStream_t stream = nullptr;
  MOK_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));

  int faults = 0, compared = 0;
  for (size_t index = 0; index < steps.size(); ++index) {
    const Step& step = steps[index];
    SCOPED_TRACE("step " + std::to_string(index) + " (" + step.routing.routing + ")");
    // The routing: Problem::generate's for a layer of this E and k (it does not depend on H or I).
    const Problem routing = testing::make_problem(
        step.routing, tokens, step.seed, LayerShape{8, 8, 0, shape.num_experts, shape.top_k});
    topk_idx.upload(routing.topk_idx);
    topk_w.upload(routing.topk_w);
    if (step.poisoned) {
      ASSERT_LT(routing.topk_idx[step.token * shape.top_k + step.slot], experts);
      // On the stream, behind whatever runs there: the device sees it as the step's routing.
      MOK_CUDA_CHECK(cudaMemcpyAsync(topk_idx.get() + step.token * shape.top_k + step.slot,
                                     &step.id, sizeof(int32_t), cudaMemcpyHostToDevice, stream));
      faulted.enqueue(x.get(), topk_idx.get(), topk_w.get(), dy.get(), y, dx, d_topk_w, tokens,
                      stream);
      const std::string fragment =
          detail::concat("expert id ", step.id, " out of range [-1, ", experts,
                         ") at rank 0 token ", step.token, " slot ", step.slot);
      expect_named_fault([&] { faulted.forward().check(stream); }, fragment, "forward");
      expect_named_fault([&] { faulted.backward().check(stream); }, fragment, "backward");
      // Still reported until the reset: a later check does not lose it.
      expect_named_fault([&] { faulted.forward().check(stream); }, fragment, "forward, again");
      faulted.forward().workspace().reset_after_error();
      faulted.backward().workspace().reset_after_error();
      EXPECT_NO_THROW(faulted.forward().check(stream)) << "the reset left an error recorded";
      EXPECT_NO_THROW(faulted.backward().check(stream)) << "the reset left an error recorded";
      ++faults;
      continue;
    }
    faulted.enqueue(x.get(), topk_idx.get(), topk_w.get(), dy.get(), y, dx, d_topk_w, tokens,
                    stream);
    faulted.forward().check(stream);
    faulted.backward().check(stream);
    const StepOutputs after_faults = faulted.outputs(y, dx, d_topk_w);
    clean.enqueue(x.get(), topk_idx.get(), topk_w.get(), dy.get(), y, dx, d_topk_w, tokens, stream);
    clean.forward().check(stream);
    clean.backward().check(stream);
    const StepOutputs never_faulted = clean.outputs(y, dx, d_topk_w);
    EXPECT_EQ(first_unwritten_output(never_faulted), "") << "an output holds unwritten elements";
    EXPECT_EQ(first_different_output(after_faults, never_faulted), "")
        << "differs from the layers that never saw a fault, after " << faults << " fault(s)";
    ++compared;
  }
  MOK_CUDA_CHECK(cudaStreamDestroy(stream));
  EXPECT_EQ(faults, 2);
  EXPECT_EQ(compared, 6);
}

}  // namespace
}  // namespace mok::comm_test
