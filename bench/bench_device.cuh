// What the GEMM benchmarks (bench_gemm, bench_gemm_fp8) share: reproducible uniform bf16 values, a
// plain device allocation, and the warmed-up median of event-timed launches.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <vector>

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

// Before a case is timed it runs for warmup_ms (at least 4 launches): under the power cap the
// clock follows the power drawn over the last fraction of a second, so after a few launches of
// warm-up a case still ran at the clock its predecessor left (docs/perf-notes/gemm.md).
inline void warm_up(const std::function<void()>& launch, double warmup_ms) {
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0;; ++i) {
    launch();
    if (i % 4 != 3) continue;
    MOK_CUDA_CHECK(cudaDeviceSynchronize());
    const std::chrono::duration<double, std::milli> elapsed =
        std::chrono::steady_clock::now() - start;
    if (elapsed.count() >= warmup_ms) break;
  }
}

// The median of `iterations` event-timed launches, after warm_up.
inline double median_ms(const std::function<void()>& launch, int iterations, double warmup_ms) {
  warm_up(launch, warmup_ms);
  cudaEvent_t start, stop;
  MOK_CUDA_CHECK(cudaEventCreate(&start));
  MOK_CUDA_CHECK(cudaEventCreate(&stop));
  std::vector<float> times;
  for (int i = 0; i < iterations; ++i) {
    MOK_CUDA_CHECK(cudaEventRecord(start));
    launch();
    MOK_CUDA_CHECK(cudaEventRecord(stop));
    MOK_CUDA_CHECK(cudaEventSynchronize(stop));
    float ms = 0.0f;
    MOK_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
    times.push_back(ms);
  }
  MOK_CUDA_CHECK(cudaEventDestroy(start));
  MOK_CUDA_CHECK(cudaEventDestroy(stop));
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

}  // namespace mok::bench
