// The mxfp8 layer's round-tripped weights and activations (mx_weights.hpp).
#include "runtime/mx_weights.hpp"

#include <algorithm>

#include <cuda_runtime.h>

#include "mok/cuda_check.hpp"
#include "mok/error.hpp"
#include "mok/precision.hpp"
#include "runtime/device_memory.hpp"

namespace mok {
namespace {

// CTAs per SM of the round-trip kernels' loops (any grid covers any size).
constexpr int kCtasPerSm = 4;

template <class Input>
void rows_of(const Input* x, bf16* out, int64_t rows, int64_t cols, const int32_t* row_bound,
             int num_sms, cudaStream_t stream) {
  if (rows == 0) return;
  MOK_CHECK_ARG(cols % quantize::kMxBlock == 0, "cols", "mxfp8 needs a multiple of 32, got ", cols);
  using Storage = std::conditional_t<sizeof(Input) == 2, uint16_t, float>;
  quantize::mx_rows_kernel<Storage>
      <<<static_cast<unsigned>(num_sms * kCtasPerSm), quantize::kMxThreads, 0, stream>>>(
          reinterpret_cast<const Storage*>(x), reinterpret_cast<uint16_t*>(out), rows, cols,
          row_bound);
  MOK_CUDA_CHECK_LAUNCH();
}

}  // namespace

void mx_rows(const bf16* x, bf16* out, int64_t rows, int64_t cols, const int32_t* row_bound,
             int num_sms, cudaStream_t stream) {
  rows_of(x, out, rows, cols, row_bound, num_sms, stream);
}

void mx_rows(const float* x, bf16* out, int64_t rows, int64_t cols, const int32_t* row_bound,
             int num_sms, cudaStream_t stream) {
  rows_of(x, out, rows, cols, row_bound, num_sms, stream);
}

void mx_columns(const bf16* x, bf16* out, int64_t cols, const quantize::MxColumnGroups& groups,
                int num_sms, cudaStream_t stream) {
  if (groups.num_groups == 0 || cols == 0) return;
  MOK_CHECK_ARG(cols % 8 == 0, "cols", "must be a multiple of 8, got ", cols);
  // Groups on y (at most 65535, the rest by the kernel's stride); enough CTAs on x for the GPU.
  const int groups_y = std::min(groups.num_groups, 65535);
  const int ctas_x = std::max(1, num_sms * kCtasPerSm / groups_y);
  quantize::mx_columns_kernel<uint16_t>
      <<<dim3(static_cast<unsigned>(ctas_x), static_cast<unsigned>(groups_y)), quantize::kMxThreads,
         0, stream>>>(reinterpret_cast<const uint16_t*>(x), reinterpret_cast<uint16_t*>(out), cols,
                      groups);
  MOK_CUDA_CHECK_LAUNCH();
}

MxWeightCache::MxWeightCache(const LayerShape& shape, int64_t experts_per_rank, bool dgrad)
    : shape_(shape), experts_(experts_per_rank), num_sms_(current_device_sm_count()) {
  validate_precision(shape, Precision::kMxfp8);
  const auto allocate = [&](DeviceLayerWeights& copy) {
    copy.gate_up_elements = experts_ * 2 * shape.intermediate * shape.hidden;
    copy.down_elements = experts_ * shape.hidden * shape.intermediate;
    copy.gate_up = device_alloc<bf16>(copy.gate_up_elements);
    copy.down = device_alloc<bf16>(copy.down_elements);
    if (shape.has_shared()) {
      copy.shared_gate_up_elements = 2 * shape.shared_intermediate * shape.hidden;
      copy.shared_down_elements = shape.hidden * shape.shared_intermediate;
      copy.shared_gate_up = device_alloc<bf16>(copy.shared_gate_up_elements);
      copy.shared_down = device_alloc<bf16>(copy.shared_down_elements);
    }
  };
  allocate(forward_);
  if (dgrad) allocate(dgrad_);
}

MxWeightCache::~MxWeightCache() {
  for (const DeviceLayerWeights* copy : {&forward_, &dgrad_}) {
    for (bf16* memory : {copy->gate_up, copy->down, copy->shared_gate_up, copy->shared_down}) {
      cudaFree(memory);  // null is fine; errors here cannot be reported from a destructor
    }
  }
}

int64_t MxWeightCache::bytes(const LayerShape& shape, int64_t experts_per_rank, bool dgrad) {
  const int64_t one = (experts_per_rank * shape.intermediate + shape.shared_intermediate) *
                      shape.hidden * 3 * 2;  // gate, up, down in bf16
  return dgrad ? 2 * one : one;
}

void MxWeightCache::quantize(const DeviceLayerWeights& weights, cudaStream_t stream) {
  MOK_CHECK_ARG(weights.gate_up_elements == forward_.gate_up_elements &&
                    weights.down_elements == forward_.down_elements &&
                    weights.shared_gate_up_elements == forward_.shared_gate_up_elements &&
                    weights.shared_down_elements == forward_.shared_down_elements,
                "weights", "the mxfp8 weight cache holds ", experts_, " experts of ",
                shape_.describe(), "; the weights given have other sizes");
  const int64_t hidden = shape_.hidden;
  const auto one_layer = [&](const bf16* gate_up, const bf16* down, int64_t experts, int64_t inter,
                             bf16* forward_gate_up, bf16* forward_down, bf16* dgrad_gate_up,
                             bf16* dgrad_down) {
    if (experts == 0 || inter == 0) return;
    // Forward: 1 x 32 along H (gate/up rows) and along I (down rows).
    mx_rows(gate_up, forward_gate_up, experts * 2 * inter, hidden, nullptr, num_sms_, stream);
    mx_rows(down, forward_down, experts * hidden, inter, nullptr, num_sms_, stream);
    if (dgrad_down == nullptr) return;
    // Dgrads: 32 x 1 down each expert's 2I gate/up rows (gate and up apart) and H down rows.
    quantize::MxColumnGroups gate_up_groups;
    gate_up_groups.group_rows = 2 * inter;
    gate_up_groups.num_groups = static_cast<int>(experts);
    gate_up_groups.gate_up = true;
    mx_columns(gate_up, dgrad_gate_up, hidden, gate_up_groups, num_sms_, stream);
    quantize::MxColumnGroups down_groups;
    down_groups.group_rows = hidden;
    down_groups.num_groups = static_cast<int>(experts);
    mx_columns(down, dgrad_down, inter, down_groups, num_sms_, stream);
  };
  one_layer(weights.gate_up, weights.down, experts_, shape_.intermediate, forward_.gate_up,
            forward_.down, dgrad_.gate_up, dgrad_.down);
  if (shape_.has_shared()) {
    one_layer(weights.shared_gate_up, weights.shared_down, 1, shape_.shared_intermediate,
              forward_.shared_gate_up, forward_.shared_down, dgrad_.shared_gate_up,
              dgrad_.shared_down);
  }
  has_weights_ = true;
}

}  // namespace mok
