// Small helpers of the runtime's layers: raw device allocations that the layer objects own (freed
// in their destructors), the check that a size fits the GEMM engine's int32 rows, the offsets
// of the one-expert group the shared expert runs as, the events that end a call's phases, and a
// fingerprint of a buffer's bytes (to compare two runs' outputs without copying them out).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <limits>

#include "mok/cuda_check.hpp"
#include "mok/error.hpp"

namespace mok {

// `count` elements (at least one byte's worth, so that an empty buffer is still a valid pointer).
template <class T>
T* device_alloc(int64_t count) {
  void* memory = nullptr;
  MOK_CUDA_CHECK(cudaMalloc(&memory, static_cast<size_t>(count > 0 ? count : 1) * sizeof(T)));
  return static_cast<T*>(memory);
}

// `value` as an int, or mok::Error naming `argument` when it does not fit the GEMM engine's
// 32-bit row indices.
inline int checked_int(int64_t value, const char* argument) {
  MOK_CHECK_ARG(value >= 0 && value <= std::numeric_limits<int32_t>::max(), argument, value,
                " does not fit the GEMM engine's 32-bit row indices");
  return static_cast<int>(value);
}

// SMs of the current CUDA device (a grid of one CTA per SM).
int current_device_sm_count();

// A 64-bit fingerprint of `bytes` bytes (from an 8-byte aligned address) of device memory on the
// current device, waiting for `stream`: the sum over words i of a bijective mix of (word i, i),
// so that the result does not depend on the order the sum is taken in, and any one word's change
// changes it. Equal buffers give equal fingerprints; two runs' outputs that differ give different
// ones but for a chance of about 2^-64.
uint64_t device_fingerprint(const void* data, int64_t bytes, cudaStream_t stream);

// The offsets {0, rows} of a group of one expert (the shared expert over a call's tokens),
// written on `stream` itself, so that the count may change between calls without a host sync.
void write_single_group_offsets(int32_t* offsets, int32_t rows, cudaStream_t stream);

// The phase marks of one call: the n-th call records events[n] on the stream, when the caller
// asked for events (null: records nothing).
class PhaseMarks {
 public:
  PhaseMarks(const cudaEvent_t* events, cudaStream_t stream) : events_(events), stream_(stream) {}
  void operator()() const {
    if (events_ != nullptr) MOK_CUDA_CHECK(cudaEventRecord(events_[recorded_], stream_));
    ++recorded_;
  }

 private:
  const cudaEvent_t* events_;
  cudaStream_t stream_;
  mutable int recorded_ = 0;
};

}  // namespace mok
