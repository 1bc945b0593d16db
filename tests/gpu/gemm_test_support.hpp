// Shared pieces of the grouped GEMM tests: device buffers, seeded data, poisoning, and the
// accuracy rule (the device's error against an fp64 oracle must stay within a small factor of
// what a same-precision host computation shows).
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <iostream>
#include <random>
#include <string>
#include <vector>

#include "device_buffer.hpp"
#include "mok/bf16.hpp"
#include "mok/cuda_check.hpp"

namespace mok::gemm_test {

// Skips the test unless a Hopper GPU (sm_90) is present.
#define MOK_REQUIRE_HOPPER()                                                       \
  do {                                                                             \
    int device_count_ = 0;                                                         \
    if (cudaGetDeviceCount(&device_count_) != cudaSuccess || device_count_ == 0) { \
      GTEST_SKIP() << "no CUDA device: the grouped GEMM needs an sm_90 GPU";       \
    }                                                                              \
    cudaDeviceProp prop_{};                                                        \
    MOK_CUDA_CHECK(cudaGetDeviceProperties(&prop_, 0));                            \
    if (prop_.major != 9)                                                          \
      GTEST_SKIP() << "device is sm_" << prop_.major << prop_.minor                \
                   << ", the grouped GEMM needs sm_90";                            \
  } while (0)

using ::mok::testing::DeviceBuffer;

inline std::vector<bf16> random_bf16(size_t count, uint32_t seed, float scale = 1.0f) {
  std::mt19937 generator(seed);
  std::uniform_real_distribution<float> uniform(-scale, scale);
  std::vector<bf16> values(count);
  for (auto& value : values) value = bf16(uniform(generator));
  return values;
}

// Prefix sums of the per-expert row counts: [E + 1] offsets.
inline std::vector<int> offsets_of(const std::vector<int>& rows) {
  std::vector<int> offsets(rows.size() + 1, 0);
  for (size_t e = 0; e < rows.size(); ++e) offsets[e + 1] = offsets[e] + rows[e];
  return offsets;
}

inline bool is_poison(bf16 value) { return value.bits == 0xffff; }
inline bool is_poison(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  return bits == 0xffffffffu;
}
inline float value_of(bf16 value) { return value.to_float(); }
inline float value_of(float value) { return value; }

// Error statistics of a result against the fp64 oracle.
struct ErrorStats {
  double max_abs = 0.0;
  double sum_squares = 0.0;
  void add(double error) {
    max_abs = std::max(max_abs, std::abs(error));
    sum_squares += error * error;
  }
};

// Compares device and same-precision host results against the oracle, element by element.
// `expected_written[i]` says whether element i must have been written (else it must still hold
// the poison). `factor` is how much worse than the host computation the device may be.
template <class T>
void expect_accuracy(const std::vector<T>& device, const std::vector<float>& host_same_precision,
                     const std::vector<double>& oracle, const std::vector<bool>& expected_written,
                     double factor, const std::string& what) {
  ASSERT_EQ(device.size(), oracle.size()) << what;
  ErrorStats device_error, host_error;
  double oracle_max = 0.0;
  size_t num_unwritten = 0, num_overwritten = 0, num_nonfinite = 0;
  for (size_t i = 0; i < device.size(); ++i) {
    if (!expected_written[i]) {
      num_overwritten += is_poison(device[i]) ? 0 : 1;
      continue;
    }
    if (is_poison(device[i])) {
      ++num_unwritten;
      continue;
    }
    const double value = value_of(device[i]);
    if (!std::isfinite(value)) ++num_nonfinite;
    device_error.add(value - oracle[i]);
    host_error.add(static_cast<double>(host_same_precision[i]) - oracle[i]);
    oracle_max = std::max(oracle_max, std::abs(oracle[i]));
  }
  EXPECT_EQ(num_unwritten, 0u) << what << ": elements left unwritten (still poisoned)";
  EXPECT_EQ(num_overwritten, 0u) << what << ": elements written outside the expected range";
  EXPECT_EQ(num_nonfinite, 0u) << what << ": non-finite results";
  const double floor = 1e-7 * oracle_max;  // for outputs the host computes exactly
  std::cout << "[ accuracy ] " << what << ": |device - fp64| / |host - fp64| = "
            << device_error.max_abs / std::max(host_error.max_abs, 1e-300) << " (max), "
            << std::sqrt(device_error.sum_squares / std::max(host_error.sum_squares, 1e-300))
            << " (L2)\n";
  EXPECT_LE(device_error.max_abs, factor * host_error.max_abs + floor)
      << what << ": max |device - fp64| vs max |host - fp64| = " << host_error.max_abs;
  EXPECT_LE(std::sqrt(device_error.sum_squares), factor * std::sqrt(host_error.sum_squares) + floor)
      << what << ": L2 error vs host same-precision L2 error " << std::sqrt(host_error.sum_squares);
}

template <class T>
bool bitwise_equal(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

}  // namespace mok::gemm_test
