// What the torch ops share: argument checks with messages that name the argument, the layer's
// shape read off the tensors, and the translation of core errors into Python exceptions.
//
// Layouts (DESIGN.md §1, [.., out, in]): x (T, H) bf16, topk_idx (T, k) int32/int64, topk_w (T, k)
// fp32, w_gate_up (E_l, 2I, H) bf16 with gate and up rows interleaved in blocks of 8 (rows
// 16b..16b+7 = gate rows 8b..8b+7, rows 16b+8..16b+15 = up rows 8b..8b+7), w_down (E_l, H, I),
// w_shared_gate_up (2I_s, H) interleaved alike, w_shared_down (H, I_s).
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

#include "mok/torch_bridge.hpp"

namespace mok::torch_ops {

using at::Tensor;
using OptionalTensor = std::optional<Tensor>;

// Rows per gate (or up) block of the interleaved gate/up layout.
inline constexpr int64_t kInterleaveRows = 8;

// Message building without iostreams (see include/mok/error.hpp for why): strings and integers.
inline void append_part(std::string& out, std::string_view text) { out += text; }
inline void append_part(std::string& out, const char* text) { out += text; }
inline void append_part(std::string& out, const std::string& text) { out += text; }
template <class Integer>
requires std::is_integral_v<Integer>
void append_part(std::string& out, Integer value) { out += std::to_string(value); }
template <class... Parts>
std::string concat(const Parts&... parts) {
  std::string out;
  (append_part(out, parts), ...);
  return out;
}

// A ValueError whose message is built by concat (one string handed to torch).
#define MOK_TORCH_CHECK(condition, ...) \
  TORCH_CHECK_VALUE(condition, ::mok::torch_ops::concat(__VA_ARGS__))

inline std::string shape_text(at::IntArrayRef sizes) {
  std::string out = "(";
  for (size_t dim = 0; dim < sizes.size(); ++dim) out += concat(dim ? ", " : "", sizes[dim]);
  return out + ")";
}

// Defined, of `dtype`, on `device`, contiguous.
inline void check_tensor(const Tensor& tensor, const char* argument, at::ScalarType dtype,
                         const c10::Device& device) {
  MOK_TORCH_CHECK(tensor.defined(), argument, ": tensor is undefined");
  MOK_TORCH_CHECK(tensor.scalar_type() == dtype, argument, ": expected dtype ",
                  c10::toString(dtype), ", got ", c10::toString(tensor.scalar_type()));
  MOK_TORCH_CHECK(tensor.device() == device, argument, ": on ", tensor.device().str(),
                  ", expected ", device.str(), " (the device of x)");
  MOK_TORCH_CHECK(tensor.is_contiguous(), argument, ": expected a contiguous tensor");
}

inline void check_sizes(const Tensor& tensor, const char* argument,
                        std::initializer_list<int64_t> expected, const char* meaning) {
  MOK_TORCH_CHECK(tensor.sizes().equals(expected), argument, ": shape ", shape_text(tensor.sizes()),
                  ", expected ", meaning, " = ", shape_text(at::IntArrayRef(expected)));
}

// The layer as one call's tensors describe it, after checking them all. shape.num_experts is
// w_gate_up's first dimension: the experts of THIS rank (all of them at EP = 1).
struct LayerCall {
  torch_bridge::Shape shape;
  bool has_shared = false;
};

inline LayerCall read_layer_call(const Tensor& x, const Tensor& topk_idx, const Tensor& topk_w,
                                 const Tensor& w_gate_up, const Tensor& w_down,
                                 const OptionalTensor& w_shared_gate_up,
                                 const OptionalTensor& w_shared_down) {
  MOK_TORCH_CHECK(x.defined() && x.dim() == 2, "x: expected (T, H), got ",
                  x.defined() ? x.dim() : 0, " dimensions");
  const c10::Device device = x.device();
  check_tensor(x, "x", at::kBFloat16, device);
  const int64_t num_tokens = x.size(0), hidden = x.size(1);

  MOK_TORCH_CHECK(topk_idx.defined() && topk_idx.dim() == 2, "topk_idx: expected (T, k), got ",
                  topk_idx.defined() ? topk_idx.dim() : 0, " dimensions");
  MOK_TORCH_CHECK(topk_idx.scalar_type() == at::kInt || topk_idx.scalar_type() == at::kLong,
                  "topk_idx: expected dtype int32 or int64, got ",
                  c10::toString(topk_idx.scalar_type()));
  check_tensor(topk_idx, "topk_idx", topk_idx.scalar_type(), device);
  const int64_t top_k = topk_idx.size(1);
  check_sizes(topk_idx, "topk_idx", {num_tokens, top_k}, "(T, k)");
  check_tensor(topk_w, "topk_w", at::kFloat, device);
  check_sizes(topk_w, "topk_w", {num_tokens, top_k}, "(T, k)");

  check_tensor(w_gate_up, "w_gate_up", at::kBFloat16, device);
  MOK_TORCH_CHECK(w_gate_up.dim() == 3, "w_gate_up: expected (E, 2I, H), got shape ",
                  shape_text(w_gate_up.sizes()));
  const int64_t num_experts = w_gate_up.size(0);
  MOK_TORCH_CHECK(w_gate_up.size(1) % (2 * kInterleaveRows) == 0,
                  "w_gate_up: gate and up interleaved in blocks of 8 rows need I to be a multiple "
                  "of 8, got 2I = ",
                  w_gate_up.size(1));
  const int64_t inter = w_gate_up.size(1) / 2;
  check_sizes(w_gate_up, "w_gate_up", {num_experts, 2 * inter, hidden}, "(E, 2I, H)");
  check_tensor(w_down, "w_down", at::kBFloat16, device);
  check_sizes(w_down, "w_down", {num_experts, hidden, inter}, "(E, H, I)");

  LayerCall call;
  const bool shared_gate_up = w_shared_gate_up.has_value() && w_shared_gate_up->defined();
  const bool shared_down = w_shared_down.has_value() && w_shared_down->defined();
  MOK_TORCH_CHECK(shared_gate_up == shared_down,
                  "w_shared_gate_up, w_shared_down: give both or none");
  call.has_shared = shared_gate_up;
  int64_t shared_inter = 0;
  if (call.has_shared) {
    check_tensor(*w_shared_gate_up, "w_shared_gate_up", at::kBFloat16, device);
    MOK_TORCH_CHECK(
        w_shared_gate_up->dim() == 2 && w_shared_gate_up->size(0) % (2 * kInterleaveRows) == 0,
        "w_shared_gate_up: expected (2I_s, H) with I_s a multiple of 8, got shape ",
        shape_text(w_shared_gate_up->sizes()));
    shared_inter = w_shared_gate_up->size(0) / 2;
    check_sizes(*w_shared_gate_up, "w_shared_gate_up", {2 * shared_inter, hidden}, "(2I_s, H)");
    check_tensor(*w_shared_down, "w_shared_down", at::kBFloat16, device);
    check_sizes(*w_shared_down, "w_shared_down", {hidden, shared_inter}, "(H, I_s)");
  }
  call.shape = {hidden, inter, shared_inter, num_experts, top_k};
  return call;
}

// Runs `body`; a core error becomes a Python ValueError (argument errors: bad shapes, ids,
// capacities) carrying the core's message.
template <class Body>
auto core_errors_as_value_errors(Body&& body) {
  try {
    return body();
  } catch (const torch_bridge::CoreError& error) {
    TORCH_CHECK_VALUE(false, std::string(error.what()));
    throw;  // not reached: the check above throws
  }
}

// The same for faults found on the device (check): a Python RuntimeError.
template <class Body>
auto core_errors_as_runtime_errors(Body&& body) {
  try {
    return body();
  } catch (const torch_bridge::CoreError& error) {
    TORCH_CHECK(false, std::string(error.what()));
    throw;  // not reached
  }
}

// Defined in cuda_ops.cpp when the extension has CUDA, else in ops.cpp (they then say so).
void check_op(int64_t workspace, int64_t device);
void reset_after_error_op(int64_t workspace, int64_t device);
// Drops the references the fp8 weight cache of a destroyed workspace kept (cuda_ops.cpp).
void forget_fp8_weights(int64_t workspace);

}  // namespace mok::torch_ops
