// The quantized weights of the FP8 layer (precision mode fp8, DESIGN.md §3): every matrix in 128 x
// 128 blocks, one fp32 scale each, made from the bf16 weights once per change of them (an
// optimizer step), not per call. W_gate, W_up and W_down each keep their own blocks, as the CPU
// reference quantizes them (src/reference/quantized_engine.cpp), in two layouts:
//
//   forward     gate/up (E_l, 2I, H) with gate and up rows interleaved in blocks of 128
//               (gemm::kSwiGluFp8Interleave), scales (E_l, 2I / 128, H / 128); down (E_l, H, I),
//               scales (E_l, H / 128, I / 128)
//   transposed  the dgrads' K-major operands (gemm::grouped_dgrad_fp8's w_t): gate/up (E_l, H,
//               2I), its columns the I gate columns then the I up columns, scales (E_l, H / 128,
//               2I / 128); down (E_l, I, H), scales (E_l, I / 128, H / 128). A block's scale is
//               its amax, which transposing does not change: the same blocks, bytes transposed.
//
// The shared expert's matrices alike, with E_l = 1 (empty without one). Besides, the activations'
// rowwise quantization both FP8 layers use (quantize_fp8_rows).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "mok/shape.hpp"
#include "runtime/layer_forward.hpp"

namespace mok {

// E4M3 bytes and their fp32 scales, one per block.
struct Fp8Operand {
  uint8_t* data = nullptr;
  float* scales = nullptr;
};

// The four matrices of one rank in one layout.
struct Fp8LayerWeights {
  Fp8Operand gate_up, down, shared_gate_up, shared_down;
};

// Device allocations of E4M3 operands owned by a layer object: (rows, cols) bytes with one fp32
// scale per (scale_rows, cols / 128); freed by free_fp8_operand (null is fine).
Fp8Operand alloc_fp8_operand(int64_t rows, int64_t cols, int64_t scale_rows);
void free_fp8_operand(Fp8Operand& operand);
int64_t fp8_operand_bytes(int64_t rows, int64_t cols, int64_t scale_rows);

// x (rows, cols) bf16 -> out 1 x 128 along cols (quantize::describe(kFp8, 1, rows, cols, 1, 128,
// false)'s bytes), for the rows below *row_bound (device: a layer's dispatched rows) or, null, all
// rows; on a grid of num_sms * 8 CTAs. cols a multiple of 128.
void quantize_fp8_rows(const bf16* x, const Fp8Operand& out, int64_t rows, int64_t cols,
                       const int32_t* row_bound, int num_sms, cudaStream_t stream);

class Fp8WeightCache {
 public:
  // H, I and I_s multiples of 128 (validate_precision). transposed: the dgrads' layout too.
  Fp8WeightCache(const LayerShape& shape, int64_t experts_per_rank, bool transposed);
  ~Fp8WeightCache();
  Fp8WeightCache(const Fp8WeightCache&) = delete;
  Fp8WeightCache& operator=(const Fp8WeightCache&) = delete;

  // Quantizes the bf16 weights (DeviceLayerWeights' layouts: gate/up interleaved in blocks of 8
  // rows) into both layouts, on `stream`.
  void quantize(const DeviceLayerWeights& weights, cudaStream_t stream);
  bool has_weights() const { return has_weights_; }
  bool has_transposed() const { return transposed_.down.data != nullptr; }
  // Whether this cache holds the weights of `experts_per_rank` experts of `shape`.
  bool fits(const LayerShape& shape, int64_t experts_per_rank) const {
    return experts_per_rank == experts_ && shape.hidden == shape_.hidden &&
           shape.intermediate == shape_.intermediate &&
           shape.shared_intermediate == shape_.shared_intermediate;
  }
  const Fp8LayerWeights& forward() const { return forward_; }
  const Fp8LayerWeights& transposed() const { return transposed_; }
  // Device bytes of the cache (E4M3 bytes and scales of every layout it holds).
  int64_t bytes() const { return bytes(shape_, experts_, has_transposed()); }
  static int64_t bytes(const LayerShape& shape, int64_t experts_per_rank, bool transposed);

 private:
  LayerShape shape_;
  int64_t experts_ = 0;
  Fp8LayerWeights forward_, transposed_;
  bool has_weights_ = false;
};

}  // namespace mok
