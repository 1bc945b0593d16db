// The mxfp8 layer's weights on the bf16 engine (precision mode mxfp8 on Hopper, docs/quantize.md):
// each matrix quantized to mxfp8 and dequantized again, as bf16 in DeviceLayerWeights' layouts
// (gate/up interleaved in blocks of 8 rows), made from the bf16 weights once per change of them
// (an optimizer step), not per call. Two copies, as the CPU reference's two quantizations:
//
//   forward   1 x 32 along each matrix's input dimension (the forward GEMMs' K): W_gate, W_up
//             along H, W_down along I
//   dgrad     1 x 32 along the dgrads' K, i.e. 32 x 1 down the rows of the forward layout: W_gate
//             and W_up each on its own along I (blocks of 32 gate or 32 up rows out of the
//             interleave), W_down along H
//
// The shared expert's matrices alike (empty without one). Besides, the activations' round trip
// both mxfp8 layers use (mx_rows, mx_columns).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/quantize/mx_round_trip.cuh"
#include "mok/shape.hpp"
#include "runtime/layer_forward.hpp"

namespace mok {

// x (rows, cols), bf16 or fp32 -> out (rows, cols) bf16: each 1 x 32 block quantized to mxfp8 and
// dequantized, for the rows below *row_bound (device) or, null, all rows. cols a multiple of 32.
void mx_rows(const bf16* x, bf16* out, int64_t rows, int64_t cols, const int32_t* row_bound,
             int num_sms, cudaStream_t stream);
void mx_rows(const float* x, bf16* out, int64_t rows, int64_t cols, const int32_t* row_bound,
             int num_sms, cudaStream_t stream);
// x (rows, cols) bf16 -> out (may be x): each 32 x 1 block down the rows of each of `groups`
// (mx_round_trip.cuh's MxColumnGroups) quantized to mxfp8 and dequantized. cols a multiple of 8.
void mx_columns(const bf16* x, bf16* out, int64_t cols, const quantize::MxColumnGroups& groups,
                int num_sms, cudaStream_t stream);

class MxWeightCache {
 public:
  // H, I and I_s multiples of 32 (validate_precision). dgrad: the dgrads' copy too.
  MxWeightCache(const LayerShape& shape, int64_t experts_per_rank, bool dgrad);
  ~MxWeightCache();
  MxWeightCache(const MxWeightCache&) = delete;
  MxWeightCache& operator=(const MxWeightCache&) = delete;

  // Round-trips the bf16 weights (DeviceLayerWeights' layouts) into every copy, on `stream`.
  void quantize(const DeviceLayerWeights& weights, cudaStream_t stream);
  bool has_weights() const { return has_weights_; }
  bool has_dgrad() const { return dgrad_.down != nullptr; }
  // Whether this cache holds the weights of `experts_per_rank` experts of `shape`.
  bool fits(const LayerShape& shape, int64_t experts_per_rank) const {
    return experts_per_rank == experts_ && shape.hidden == shape_.hidden &&
           shape.intermediate == shape_.intermediate &&
           shape.shared_intermediate == shape_.shared_intermediate;
  }
  const DeviceLayerWeights& forward() const { return forward_; }
  const DeviceLayerWeights& dgrad() const { return dgrad_; }
  // Device bytes of the cache (every copy it holds).
  int64_t bytes() const { return bytes(shape_, experts_, has_dgrad()); }
  static int64_t bytes(const LayerShape& shape, int64_t experts_per_rank, bool dgrad);

 private:
  LayerShape shape_;
  int64_t experts_ = 0;
  int num_sms_ = 0;
  DeviceLayerWeights forward_, dgrad_;
  bool has_weights_ = false;
};

}  // namespace mok
