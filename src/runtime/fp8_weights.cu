// The FP8 layer's weight cache (fp8_weights.hpp): allocations sized from the shape, the 128 x 128
// quantization of the bf16 weights and the transposed copies made from it.
#include "runtime/fp8_weights.hpp"

#include <cuda_runtime.h>

#include "kernels/quantize/layer_kernels.cuh"
#include "kernels/quantize/rowwise_kernel.cuh"
#include "mok/cuda_check.hpp"
#include "mok/error.hpp"
#include "runtime/device_memory.hpp"

namespace mok {
namespace {

constexpr int64_t kBlock = 128;  // the recipe's weight blocks: 128 x 128

// batch matrices (rows, cols) bf16 -> 128 x 128 blocks in the forward layout and, when
// `transposed` has data, the transposed one; gate_up: the rows read through GateUpRows and the
// transposed columns the gate blocks, then the up blocks.
void quantize_weight(const bf16* x, int64_t batch, int64_t rows, int64_t cols, bool gate_up,
                     const Fp8Operand& out, const Fp8Operand& transposed, cudaStream_t stream) {
  const int64_t blocks = batch * (rows / kBlock) * (cols / kBlock);
  MOK_CHECK_ARG(blocks < (int64_t{1} << 31), "weights", "too many 128 x 128 blocks: ", blocks);
  if (blocks == 0) return;
  const auto* input = reinterpret_cast<const uint16_t*>(x);
  const auto grid = static_cast<unsigned>(blocks);
  constexpr int kThreads = quantize::kWeightBlockThreads;
  if (gate_up) {
    quantize::quantize_weight_block_kernel<quantize::GateUpRows><<<grid, kThreads, 0, stream>>>(
        input, out.data, out.scales, transposed.data, transposed.scales, rows, cols,
        quantize::GateUpBlocks{rows / 2 / kBlock});
  } else {
    quantize::quantize_weight_block_kernel<quantize::SameRows>
        <<<grid, kThreads, 0, stream>>>(input, out.data, out.scales, transposed.data,
                                        transposed.scales, rows, cols, quantize::SameBlocks{});
  }
  MOK_CUDA_CHECK_LAUNCH();
}

}  // namespace

Fp8Operand alloc_fp8_operand(int64_t rows, int64_t cols, int64_t scale_rows) {
  return {device_alloc<uint8_t>(rows * cols), device_alloc<float>(scale_rows * (cols / kBlock))};
}

void free_fp8_operand(Fp8Operand& operand) {
  cudaFree(operand.data);  // null is fine; errors here cannot be reported from a destructor
  cudaFree(operand.scales);
  operand = {};
}

int64_t fp8_operand_bytes(int64_t rows, int64_t cols, int64_t scale_rows) {
  return rows * cols + scale_rows * (cols / kBlock) * 4;
}

void quantize_fp8_rows(const bf16* x, const Fp8Operand& out, int64_t rows, int64_t cols,
                       const int32_t* row_bound, int num_sms, cudaStream_t stream) {
  if (rows == 0) return;
  constexpr int kVector = quantize::InputVector<uint16_t>::kElements;
  quantize::quantize_rowwise_kernel<uint16_t, quantize::Format::kFp8, 128>
      <<<static_cast<unsigned>(num_sms * quantize::kRowwiseCtasPerSm), quantize::kRowwiseThreads, 0,
         stream>>>(reinterpret_cast<const uint16_t*>(x), out.data, out.scales,
                   rows * cols / kVector, row_bound, cols / kVector);
  MOK_CUDA_CHECK_LAUNCH();
}

Fp8WeightCache::Fp8WeightCache(const LayerShape& shape, int64_t experts_per_rank, bool transposed)
    : shape_(shape), experts_(experts_per_rank) {
  const int64_t experts = experts_per_rank, hidden = shape.hidden;
  const int64_t inter = shape.intermediate, shared_inter = shape.shared_intermediate;
  MOK_CHECK_ARG(hidden % kBlock == 0 && inter % kBlock == 0 && shared_inter % kBlock == 0, "shape",
                "the fp8 weights need H, I and I_s multiples of 128: ", shape.describe());
  forward_.gate_up = alloc_fp8_operand(experts * 2 * inter, hidden, experts * 2 * inter / kBlock);
  forward_.down = alloc_fp8_operand(experts * hidden, inter, experts * hidden / kBlock);
  if (transposed) {
    transposed_.gate_up = alloc_fp8_operand(experts * hidden, 2 * inter, experts * hidden / kBlock);
    transposed_.down = alloc_fp8_operand(experts * inter, hidden, experts * inter / kBlock);
  }
  if (shape.has_shared()) {
    forward_.shared_gate_up =
        alloc_fp8_operand(2 * shared_inter, hidden, 2 * shared_inter / kBlock);
    forward_.shared_down = alloc_fp8_operand(hidden, shared_inter, hidden / kBlock);
    if (transposed) {
      transposed_.shared_gate_up = alloc_fp8_operand(hidden, 2 * shared_inter, hidden / kBlock);
      transposed_.shared_down = alloc_fp8_operand(shared_inter, hidden, shared_inter / kBlock);
    }
  }
}

Fp8WeightCache::~Fp8WeightCache() {
  for (Fp8LayerWeights* layout : {&forward_, &transposed_}) {
    for (Fp8Operand* operand :
         {&layout->gate_up, &layout->down, &layout->shared_gate_up, &layout->shared_down}) {
      free_fp8_operand(*operand);
    }
  }
}

int64_t Fp8WeightCache::bytes(const LayerShape& shape, int64_t experts_per_rank, bool transposed) {
  const int64_t experts = experts_per_rank, hidden = shape.hidden;
  const int64_t inter = shape.intermediate, shared_inter = shape.shared_intermediate;
  // One layout; the transposed one has the same elements and as many blocks.
  int64_t layout = fp8_operand_bytes(experts * 2 * inter, hidden, experts * 2 * inter / kBlock) +
                   fp8_operand_bytes(experts * hidden, inter, experts * hidden / kBlock);
  if (shape.has_shared()) {
    layout += fp8_operand_bytes(2 * shared_inter, hidden, 2 * shared_inter / kBlock) +
              fp8_operand_bytes(hidden, shared_inter, hidden / kBlock);
  }
  return transposed ? 2 * layout : layout;
}

void Fp8WeightCache::quantize(const DeviceLayerWeights& weights, cudaStream_t stream) {
  const int64_t experts = experts_, hidden = shape_.hidden, inter = shape_.intermediate;
  const int64_t shared_inter = shape_.shared_intermediate;
  const auto check = [](const bf16* data, int64_t elements, int64_t expected, const char* name) {
    MOK_CHECK_ARG(elements == expected, name, elements, " elements, the shape needs ", expected);
    MOK_CHECK_ARG(expected == 0 || data != nullptr, name, "null pointer for ", expected,
                  " elements");
  };
  check(weights.gate_up, weights.gate_up_elements, experts * 2 * inter * hidden, "weights.gate_up");
  check(weights.down, weights.down_elements, experts * hidden * inter, "weights.down");
  const int64_t shared = shape_.has_shared() ? 1 : 0;
  check(weights.shared_gate_up, weights.shared_gate_up_elements, shared * 2 * shared_inter * hidden,
        "weights.shared_gate_up");
  check(weights.shared_down, weights.shared_down_elements, shared * hidden * shared_inter,
        "weights.shared_down");
  // Row blocks of 128 never straddle gate and up: I is a multiple of 128.
  quantize_weight(weights.gate_up, experts, 2 * inter, hidden, /*gate_up=*/true, forward_.gate_up,
                  transposed_.gate_up, stream);
  quantize_weight(weights.down, experts, hidden, inter, /*gate_up=*/false, forward_.down,
                  transposed_.down, stream);
  if (shape_.has_shared()) {
    quantize_weight(weights.shared_gate_up, 1, 2 * shared_inter, hidden, true,
                    forward_.shared_gate_up, transposed_.shared_gate_up, stream);
    quantize_weight(weights.shared_down, 1, hidden, shared_inter, false, forward_.shared_down,
                    transposed_.shared_down, stream);
  }
  has_weights_ = true;
}

}  // namespace mok
