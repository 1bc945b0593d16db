// A typed device allocation for GPU tests: upload, download, and poison (every byte 0xff, which
// is NaN in bf16 and fp32, so an element a kernel failed to write cannot pass a check).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <vector>

#include "mok/cuda_check.hpp"

namespace mok::testing {

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
  void upload(const std::vector<T>& host) {
    MOK_CUDA_CHECK(cudaMemcpy(data_, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
  }
  std::vector<T> download() const {
    std::vector<T> host(count_);
    MOK_CUDA_CHECK(cudaMemcpy(host.data(), data_, count_ * sizeof(T), cudaMemcpyDeviceToHost));
    return host;
  }
  void poison() { MOK_CUDA_CHECK(cudaMemset(data_, 0xff, count_ * sizeof(T))); }

 private:
  T* data_ = nullptr;
  size_t count_;
};

}  // namespace mok::testing
