// The bf16 engine's gate/up interleave as a map: the I gate columns then the I up columns of a
// gate/up tensor (d_gate_up, [d_a | d_b]), or the gate rows then the up rows of W_gate, W_up, to
// the interleaved position the engine reads (blocks of 8: DeviceLayerWeights, gemm::
// interleave_gate_up). Used by the fp8 and mxfp8 layers' quantizations. Host and device.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace mok::quantize {

// d_gate_up's column `col` (the I gate columns, then the I up columns) as a row of the gate/up
// weight gradient, whose gate and up rows interleave in blocks of 8 (DeviceLayerWeights).
struct GateUp8Columns {
  int64_t inter;

  __host__ __device__ __forceinline__ int64_t operator()(int64_t col) const {
    const bool up = col >= inter;
    const int64_t index = up ? col - inter : col;
    return index / 8 * 16 + (up ? 8 : 0) + index % 8;
  }
};

}  // namespace mok::quantize
