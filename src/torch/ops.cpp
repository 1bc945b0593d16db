// torch custom ops over the C++ core. The schemas, the CPU kernels (the CPU backend, one rank) and
// the workspace ops live here; the CUDA kernel of mok::forward (the GPU layer) is in cuda_ops.cpp,
// the CUDA kernel of mok::backward (a labelled plain-PyTorch reference) and every fake (meta)
// implementation and autograd formula in python/mok/_ops.py. Argument errors become Python
// ValueErrors carrying the core's message.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstring>
#include <string>
#include <tuple>
#include <vector>

#include "mok/torch_bridge.hpp"
#include "torch_args.hpp"

namespace mok::torch_ops {

namespace {

namespace bridge = ::mok::torch_bridge;

bridge::HostTensor host_tensor(const Tensor& tensor) {
  return {tensor.data_ptr(), std::vector<int64_t>(tensor.sizes().begin(), tensor.sizes().end())};
}

// (.., 2n, H) interleaved -> the gate (half 0) or up (half 1) rows (.., n, H), as a new
// contiguous tensor: the CPU backend reads the separate layouts.
Tensor deinterleave(const Tensor& fused, int64_t half) {
  std::vector<int64_t> blocks(fused.sizes().begin(), fused.sizes().end());
  const int64_t hidden = blocks.back(), rows = blocks[blocks.size() - 2];
  blocks.pop_back();
  blocks.pop_back();
  std::vector<int64_t> separate = blocks;
  blocks.insert(blocks.end(), {rows / (2 * kInterleaveRows), 2, kInterleaveRows, hidden});
  separate.insert(separate.end(), {rows / 2, hidden});
  return fused.view(blocks)
      .select(static_cast<int64_t>(blocks.size()) - 3, half)
      .reshape(separate)
      .contiguous();
}

// gate, up (.., n, H) -> (.., 2n, H) interleaved in blocks of 8 rows.
Tensor interleave(const Tensor& gate, const Tensor& up) {
  std::vector<int64_t> blocks(gate.sizes().begin(), gate.sizes().end());
  const int64_t hidden = blocks.back(), rows = blocks[blocks.size() - 2];
  blocks.pop_back();
  blocks.pop_back();
  std::vector<int64_t> fused = blocks;
  blocks.insert(blocks.end(), {rows / kInterleaveRows, kInterleaveRows, hidden});
  fused.insert(fused.end(), {2 * rows, hidden});
  return at::stack({gate.view(blocks), up.view(blocks)}, static_cast<int64_t>(blocks.size()) - 2)
      .view(fused);
}

// The CPU backend's inputs, with the separate gate/up tensors they point into kept alive.
struct CpuCall {
  LayerCall layer;
  Tensor topk_idx;  // int32
  Tensor gate, up, shared_gate, shared_up;
  bridge::CpuLayerInputs inputs;
};

CpuCall cpu_call(const Tensor& x, const Tensor& topk_idx, const Tensor& topk_w,
                 const Tensor& w_gate_up, const Tensor& w_down,
                 const OptionalTensor& w_shared_gate_up, const OptionalTensor& w_shared_down,
                 int64_t workspace, c10::string_view precision) {
  CpuCall call;
  call.layer =
      read_layer_call(x, topk_idx, topk_w, w_gate_up, w_down, w_shared_gate_up, w_shared_down);
  MOK_TORCH_CHECK(x.device().is_cpu(), "x: expected a CPU tensor, got one on ", x.device().str());
  MOK_TORCH_CHECK(workspace == 0, "workspace: CPU tensors run the CPU backend, which takes no GPU ",
                  "workspace (got handle ", workspace, ")");
  const int64_t num_experts = call.layer.shape.num_experts;
  if (topk_idx.scalar_type() == at::kLong && topk_idx.numel() > 0) {
    const int64_t low = topk_idx.min().item<int64_t>(), high = topk_idx.max().item<int64_t>();
    MOK_TORCH_CHECK(low >= -1 && high < num_experts, "topk_idx: expert id ", low < -1 ? low : high,
                    " out of range [0, ", num_experts, ")");
  }
  call.topk_idx = topk_idx.to(at::kInt).contiguous();
  call.gate = deinterleave(w_gate_up, 0);
  call.up = deinterleave(w_gate_up, 1);
  call.inputs.x = host_tensor(x);
  call.inputs.topk_idx = host_tensor(call.topk_idx);
  call.inputs.topk_w = host_tensor(topk_w);
  call.inputs.gate = host_tensor(call.gate);
  call.inputs.up = host_tensor(call.up);
  call.inputs.down = host_tensor(w_down);
  call.inputs.precision = std::string(precision.data(), precision.size());
  if (call.layer.has_shared) {
    call.shared_gate = deinterleave(*w_shared_gate_up, 0);
    call.shared_up = deinterleave(*w_shared_gate_up, 1);
    call.inputs.shared_gate = host_tensor(call.shared_gate);
    call.inputs.shared_up = host_tensor(call.shared_up);
    call.inputs.shared_down = host_tensor(*w_shared_down);
  }
  return call;
}

Tensor forward_cpu(const Tensor& x, const Tensor& topk_idx, const Tensor& topk_w,
                   const Tensor& w_gate_up, const Tensor& w_down,
                   const OptionalTensor& w_shared_gate_up, const OptionalTensor& w_shared_down,
                   int64_t workspace, c10::string_view precision) {
  return core_errors_as_value_errors([&] {
    CpuCall call = cpu_call(x, topk_idx, topk_w, w_gate_up, w_down, w_shared_gate_up, w_shared_down,
                            workspace, precision);
    Tensor y = at::empty({x.size(0), x.size(1)}, x.options());
    bridge::cpu_forward(call.layer.shape, call.inputs, y.data_ptr());
    return y;
  });
}

// The CPU backend keeps no context: its backward recomputes (the same bits), so the saved tensors
// are empty.
std::tuple<Tensor, Tensor, Tensor> forward_save_cpu(const Tensor& x, const Tensor& topk_idx,
                                                    const Tensor& topk_w, const Tensor& w_gate_up,
                                                    const Tensor& w_down,
                                                    const OptionalTensor& w_shared_gate_up,
                                                    const OptionalTensor& w_shared_down,
                                                    int64_t workspace, c10::string_view precision) {
  Tensor y = forward_cpu(x, topk_idx, topk_w, w_gate_up, w_down, w_shared_gate_up, w_shared_down,
                         workspace, precision);
  return {y, at::empty({0}, x.options()), at::empty({0}, x.options())};
}

using BackwardResult = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor>;

BackwardResult backward_cpu(const Tensor& dy, const Tensor& x, const Tensor& topk_idx,
                            const Tensor& topk_w, const Tensor& w_gate_up, const Tensor& w_down,
                            const OptionalTensor& w_shared_gate_up,
                            const OptionalTensor& w_shared_down, int64_t workspace, bool bf16_grads,
                            const OptionalTensor& /*saved_gate_up*/,
                            const OptionalTensor& /*saved_shared_gate_up*/,
                            c10::string_view precision) {
  return core_errors_as_value_errors([&] {
    CpuCall call = cpu_call(x, topk_idx, topk_w, w_gate_up, w_down, w_shared_gate_up, w_shared_down,
                            workspace, precision);
    check_tensor(dy, "dy", at::kBFloat16, x.device());
    check_sizes(dy, "dy", {x.size(0), x.size(1)}, "(T, H)");
    call.inputs.dy = host_tensor(dy);
    const at::TensorOptions fp32 = x.options().dtype(at::kFloat);
    Tensor dx = at::empty_like(x);
    Tensor d_topk_w = at::empty({topk_w.size(0), topk_w.size(1)}, fp32);
    Tensor grad_gate = at::empty(call.gate.sizes(), fp32),
           grad_up = at::empty(call.up.sizes(), fp32);
    Tensor grad_down = at::empty(w_down.sizes(), fp32);
    Tensor grad_shared_gate, grad_shared_up;
    Tensor grad_shared_down = at::empty({0}, fp32);
    bridge::CpuLayerGradients grads;
    grads.dx = dx.data_ptr();
    grads.d_topk_w = d_topk_w.data_ptr<float>();
    grads.gate = grad_gate.data_ptr<float>();
    grads.up = grad_up.data_ptr<float>();
    grads.down = grad_down.data_ptr<float>();
    if (call.layer.has_shared) {
      grad_shared_gate = at::empty(call.shared_gate.sizes(), fp32);
      grad_shared_up = at::empty(call.shared_up.sizes(), fp32);
      grad_shared_down = at::empty(w_shared_down->sizes(), fp32);
      grads.shared_gate = grad_shared_gate.data_ptr<float>();
      grads.shared_up = grad_shared_up.data_ptr<float>();
      grads.shared_down = grad_shared_down.data_ptr<float>();
    }
    bridge::cpu_backward(call.layer.shape, call.inputs, grads);
    Tensor grad_shared_gate_up =
        call.layer.has_shared ? interleave(grad_shared_gate, grad_shared_up) : at::empty({0}, fp32);
    // bf16_grads: the fp32 sums rounded once, as the GPU's bf16 weight gradients are.
    auto out = [&](const Tensor& grad) { return bf16_grads ? grad.to(at::kBFloat16) : grad; };
    return BackwardResult{dx,
                          d_topk_w,
                          out(interleave(grad_gate, grad_up)),
                          out(grad_down),
                          out(grad_shared_gate_up),
                          out(grad_shared_down)};
  });
}

// ---- workspace ops (no tensor arguments that pick a device: one kernel for every backend) ------

Tensor nccl_unique_id_op() {
  return core_errors_as_value_errors([&] {
    const std::vector<uint8_t> bytes = bridge::nccl_unique_id();
    Tensor id = at::empty({static_cast<int64_t>(bytes.size())}, at::TensorOptions(at::kByte));
    std::memcpy(id.data_ptr(), bytes.data(), bytes.size());
    return id;
  });
}

int64_t create_workspace_op(const Tensor& unique_id, int64_t rank, int64_t num_ranks,
                            int64_t device, int64_t hidden, int64_t intermediate,
                            int64_t shared_intermediate, int64_t num_experts, int64_t top_k,
                            int64_t max_tokens_per_rank, int64_t copy_ctas, int64_t minibatch_rows,
                            int64_t ring_rows, bool low_memory_backward) {
  return core_errors_as_value_errors([&] {
    bridge::WorkspaceSpec spec;
    spec.shape = {hidden, intermediate, shared_intermediate, num_experts, top_k};
    spec.tokens_max = max_tokens_per_rank;
    spec.device = static_cast<int>(device);
    spec.rank = static_cast<int>(rank);
    spec.num_ranks = static_cast<int>(num_ranks);
    spec.copy_ctas = static_cast<int>(copy_ctas);
    spec.minibatch_rows = static_cast<int>(minibatch_rows);
    spec.ring_rows = ring_rows;
    spec.low_memory_backward = low_memory_backward;
    if (unique_id.defined() && unique_id.numel() > 0) {
      MOK_TORCH_CHECK(unique_id.scalar_type() == at::kByte && unique_id.device().is_cpu() &&
                          unique_id.is_contiguous(),
                      "unique_id: expected a contiguous uint8 CPU tensor (nccl_unique_id)");
      const auto* bytes = static_cast<const uint8_t*>(unique_id.data_ptr());
      spec.unique_id.assign(bytes, bytes + unique_id.numel());
    }
    return bridge::create_workspace(spec);
  });
}

void destroy_workspace_op(int64_t workspace) {
  core_errors_as_value_errors([&] { bridge::destroy_workspace(workspace); });
  forget_fp8_weights(workspace);
}

bool have_gpu_layer_op() { return bridge::have_gpu_layer(); }

int64_t min_ring_rows_op() { return bridge::min_ring_rows(); }

}  // namespace

#if !defined(MOK_TORCH_WITH_CUDA)
// An extension built without CUDA: the device checks have nothing to check.
void check_op(int64_t, int64_t) {
  TORCH_CHECK_NOT_IMPLEMENTED(false, "mok::check: this build of mok has no GPU layer");
}
void reset_after_error_op(int64_t, int64_t) {
  TORCH_CHECK_NOT_IMPLEMENTED(false, "mok::reset_after_error: this build of mok has no GPU layer");
}
void forget_fp8_weights(int64_t) {}
#endif

TORCH_LIBRARY(mok, m) {
  // workspace: a handle from create_workspace; 0 = none (CPU) or the automatic EP = 1 workspace
  // of the tensors' GPU. precision: "bf16", "fp8" or "mxfp8" (MoKConfig.precision), on CPU and
  // GPU tensors alike (mxfp8 on the GPU: a numerics mode on the bf16 engine, docs/quantize.md).
  m.def(
      "forward(Tensor x, Tensor topk_idx, Tensor topk_w, Tensor w_gate_up, Tensor w_down, "
      "Tensor? w_shared_gate_up, Tensor? w_shared_down, int workspace=0, "
      "str precision=\"bf16\") -> Tensor");
  // The forward that also returns what a save-mode backward reads: the gate/up pre-activations
  // (rows, 2I) and the shared expert's (T, 2I_s) bf16 (empty on CPU: its backward recomputes).
  m.def(
      "forward_save(Tensor x, Tensor topk_idx, Tensor topk_w, Tensor w_gate_up, Tensor w_down, "
      "Tensor? w_shared_gate_up, Tensor? w_shared_down, int workspace=0, "
      "str precision=\"bf16\") -> (Tensor, Tensor, Tensor)");
  // saved_*: forward_save's context (save mode), or None (recompute mode): the same bits.
  m.def(
      "backward(Tensor dy, Tensor x, Tensor topk_idx, Tensor topk_w, Tensor w_gate_up, "
      "Tensor w_down, Tensor? w_shared_gate_up, Tensor? w_shared_down, int workspace=0, "
      "bool bf16_grads=False, Tensor? saved_gate_up=None, Tensor? saved_shared_gate_up=None, "
      "str precision=\"bf16\") -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def("nccl_unique_id() -> Tensor", &nccl_unique_id_op);
  m.def(
      "create_workspace(Tensor unique_id, int rank, int num_ranks, int device, int hidden, "
      "int intermediate, int shared_intermediate, int num_experts, int top_k, "
      "int max_tokens_per_rank, int copy_ctas, int minibatch_rows=0, int ring_rows=0, "
      "bool low_memory_backward=False) -> int",
      &create_workspace_op);
  m.def("destroy_workspace(int workspace) -> ()", &destroy_workspace_op);
  m.def("check(int workspace, int device) -> ()", &check_op);
  m.def("reset_after_error(int workspace, int device) -> ()", &reset_after_error_op);
  m.def("have_gpu_layer() -> bool", &have_gpu_layer_op);
  m.def("min_ring_rows() -> int", &min_ring_rows_op);
}

TORCH_LIBRARY_IMPL(mok, CPU, m) {
  m.impl("forward", &forward_cpu);
  m.impl("forward_save", &forward_save_cpu);
  m.impl("backward", &backward_cpu);
}

}  // namespace mok::torch_ops
