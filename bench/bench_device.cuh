// Device data of the GEMM benchmarks (bench_gemm, bench_gemm_fp8): reproducible uniform bf16
// values and a plain device allocation.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "mok/bf16.hpp"
#include "mok/cuda_check.hpp"

namespace mok::bench {

// Uniform values in [-scale, scale) from a hash of the index: random, reproducible, never zero
// over a whole row.
__global__ inline void fill_random(__nv_bfloat16* data, size_t count, uint32_t seed, float scale) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    uint32_t h = static_cast<uint32_t>(i) * 0x9e3779b1u ^ seed ^ static_cast<uint32_t>(i >> 32);
    h ^= h >> 16;
    h *= 0x85ebca6bu;
    h ^= h >> 13;
    h *= 0xc2b2ae35u;
    h ^= h >> 16;
    const float unit = static_cast<float>(h >> 8) * (1.0f / 16777216.0f);
    data[i] = __float2bfloat16_rn((2.0f * unit - 1.0f) * scale);
  }
}

// `bytes` of device memory, freed with the object.
struct DeviceBytes {
  void* data = nullptr;
  explicit DeviceBytes(size_t bytes) { MOK_CUDA_CHECK(cudaMalloc(&data, bytes)); }
  DeviceBytes(const DeviceBytes&) = delete;
  DeviceBytes& operator=(const DeviceBytes&) = delete;
  ~DeviceBytes() { cudaFree(data); }
  mok::bf16* bf16() const { return static_cast<mok::bf16*>(data); }
  template <class T>
  T* as() const {
    return static_cast<T*>(data);
  }
};

}  // namespace mok::bench
