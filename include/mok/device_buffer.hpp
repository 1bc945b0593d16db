// A typed device allocation (cudaMalloc, freed on destruction) with host copies both ways and a
// poison (every byte 0xff: NaN in bf16 and fp32, so an element a kernel failed to write shows).
// For C++ users of the GPU API, the runner, the benchmarks and the GPU tests.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <vector>

#include "mok/cuda_check.hpp"

namespace mok {

template <class T>
class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t count) : count_(count) {
    MOK_CUDA_CHECK(cudaMalloc(&data_, std::max<size_t>(count, 1) * sizeof(T)));
  }
  explicit DeviceBuffer(const std::vector<T>& host) : DeviceBuffer(host.size()) { upload(host); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() { cudaFree(data_); }

  T* get() const { return data_; }
  size_t size() const { return count_; }
  size_t bytes() const { return count_ * sizeof(T); }
  // size() elements from `host`.
  void upload(const T* host) {
    MOK_CUDA_CHECK(cudaMemcpy(data_, host, bytes(), cudaMemcpyHostToDevice));
  }
  void upload(const std::vector<T>& host) {
    MOK_CUDA_CHECK(cudaMemcpy(data_, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
  }
  // size() elements into `host`.
  void download(T* host) const {
    MOK_CUDA_CHECK(cudaMemcpy(host, data_, bytes(), cudaMemcpyDeviceToHost));
  }
  std::vector<T> download() const {
    std::vector<T> host(count_);
    download(host.data());
    return host;
  }
  void poison() { MOK_CUDA_CHECK(cudaMemset(data_, 0xff, bytes())); }

 private:
  T* data_ = nullptr;
  size_t count_;
};

}  // namespace mok
