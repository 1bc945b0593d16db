// The SwiGLU epilogue's arithmetic: its branch-free reciprocal and 1 + exp are checked
// exhaustively against the IEEE division and numerics::one_plus_exp over the whole ranges they
// serve, and the in-place tile SwiGLU (fast path and the generic fallback for gates <= -87) is
// checked bitwise against the host definition.
#include <cuda_runtime.h>

#include <cmath>
#include <random>
#include <vector>

#include "gemm_test_support.hpp"
#include "kernels/gemm/swiglu.cuh"
#include "mok/detail/numerics.hpp"

namespace mok::gemm_test {
namespace {

using namespace mok::gemm;

constexpr uint32_t kOneBits = 0x3f800000u;        // 1.0f
constexpr uint32_t kTwoPow126Bits = 0x7e800000u;  // 2^126

__global__ void count_reciprocal_mismatches(unsigned long long* mismatches,
                                            uint32_t* first_mismatch_bits) {
  const uint32_t count = kTwoPow126Bits - kOneBits;
  for (uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < count; i += gridDim.x * blockDim.x) {
    const float d = __uint_as_float(kOneBits + i);
    if (__float_as_uint(reciprocal_rn(d)) != __float_as_uint(__fdiv_rn(1.0f, d))) {
      atomicAdd(mismatches, 1ull);
      atomicMin(first_mismatch_bits, kOneBits + i);
    }
  }
}

TEST(GemmSwiGlu, ReciprocalIsCorrectlyRoundedOnOneToTwoPow126) {
  MOK_REQUIRE_HOPPER();
  DeviceBuffer<unsigned long long> mismatches(1);
  DeviceBuffer<uint32_t> first(1);
  MOK_CUDA_CHECK(cudaMemset(mismatches.get(), 0, sizeof(unsigned long long)));
  MOK_CUDA_CHECK(cudaMemset(first.get(), 0xff, sizeof(uint32_t)));
  count_reciprocal_mismatches<<<4096, 256>>>(mismatches.get(), first.get());
  MOK_CUDA_CHECK_LAUNCH();
  MOK_CUDA_CHECK(cudaDeviceSynchronize());
  EXPECT_EQ(mismatches.download()[0], 0ull)
      << "reciprocal_rn differs from 1/d; first at d bits 0x" << std::hex << first.download()[0];
}

// Every float of (-87, 87): the magnitudes below 87 with either sign.
__global__ void count_one_plus_exp_mismatches(unsigned long long* mismatches,
                                              uint32_t* first_mismatch_bits) {
  constexpr uint32_t kEightySevenBits = 0x42ae0000u;  // 87.0f
  constexpr uint64_t kCount = 2ull * kEightySevenBits;
  for (uint64_t i = blockIdx.x * static_cast<uint64_t>(blockDim.x) + threadIdx.x; i < kCount;
       i += static_cast<uint64_t>(gridDim.x) * blockDim.x) {
    const uint32_t magnitude = static_cast<uint32_t>(i % kEightySevenBits);
    const uint32_t bits = magnitude | (i < kEightySevenBits ? 0u : 0x80000000u);
    const float t = __uint_as_float(bits);
    if (__float_as_uint(one_plus_exp_fast(t)) != __float_as_uint(numerics::one_plus_exp(t))) {
      atomicAdd(mismatches, 1ull);
      atomicMin(first_mismatch_bits, bits);
    }
  }
}

TEST(GemmSwiGlu, OnePlusExpFastMatchesDefinitionForEveryFloatBelow87InMagnitude) {
  MOK_REQUIRE_HOPPER();
  DeviceBuffer<unsigned long long> mismatches(1);
  DeviceBuffer<uint32_t> first(1);
  MOK_CUDA_CHECK(cudaMemset(mismatches.get(), 0, sizeof(unsigned long long)));
  MOK_CUDA_CHECK(cudaMemset(first.get(), 0xff, sizeof(uint32_t)));
  count_one_plus_exp_mismatches<<<4096, 256>>>(mismatches.get(), first.get());
  MOK_CUDA_CHECK_LAUNCH();
  MOK_CUDA_CHECK(cudaDeviceSynchronize());
  EXPECT_EQ(mismatches.download()[0], 0ull)
      << "one_plus_exp_fast differs from one_plus_exp; first at t bits 0x" << std::hex
      << first.download()[0];
}

constexpr int kTileValues = 128;  // one consumer thread's accumulators

__global__ void apply_swiglu_in_place(const float* input, float* output, int num_threads) {
  const int thread = blockIdx.x * blockDim.x + threadIdx.x;
  if (thread >= num_threads) return;
  float accum[kTileValues];
#pragma unroll
  for (int i = 0; i < kTileValues; ++i) accum[i] = input[thread * kTileValues + i];
  swiglu_in_place<kTileValues>(accum);
#pragma unroll
  for (int i = 0; i < kTileValues; ++i) output[thread * kTileValues + i] = accum[i];
}

// Gates over the whole useful range and its edges; every 7th thread holds one gate with
// |g| >= 87 (or at the edge just inside) so that thread takes the generic path.
TEST(GemmSwiGlu, InPlaceTileMatchesHostDefinitionBitwise) {
  MOK_REQUIRE_HOPPER();
  constexpr int kThreads = 8192;
  std::mt19937 generator(31);
  std::uniform_real_distribution<float> wide(-90.0f, 90.0f), narrow(-6.0f, 6.0f);
  const float edges[] = {-87.0f,    -86.99999f, -88.0f, -100.0f, 87.0f,
                         86.99999f, 88.6f,      0.0f,   1e-30f};
  std::vector<float> input(static_cast<size_t>(kThreads) * kTileValues);
  for (size_t i = 0; i < input.size(); ++i) {
    input[i] = (i % 3 == 0) ? wide(generator) : narrow(generator);
  }
  for (int thread = 0; thread < kThreads; ++thread) {
    float* values = &input[static_cast<size_t>(thread) * kTileValues];
    if (thread % 7 == 0) {
      values[8 * (thread % 16) + thread % 4] = edges[thread % 9] - 10.0f * (thread % 2);
    } else {
      // keep every gate of this thread inside (-87, 87): the fast path
      for (int pair = 0; pair < kTileValues / 2; ++pair) {
        float& gate = values[8 * (pair / 4) + pair % 4];
        if (!(std::fabs(gate) < kFastSwiGluGateLimit)) gate = gate > 0.0f ? 86.5f : -86.5f;
      }
    }
  }
  DeviceBuffer<float> input_device(input.size()), output_device(input.size());
  input_device.upload(input);
  output_device.poison();
  apply_swiglu_in_place<<<kThreads / 128, 128>>>(input_device.get(), output_device.get(), kThreads);
  MOK_CUDA_CHECK_LAUNCH();
  MOK_CUDA_CHECK(cudaDeviceSynchronize());
  const auto output = output_device.download();
  size_t mismatches = 0, checked = 0;
  for (int thread = 0; thread < kThreads; ++thread) {
    const float* in = &input[static_cast<size_t>(thread) * kTileValues];
    const float* out = &output[static_cast<size_t>(thread) * kTileValues];
    for (int pair = 0; pair < kTileValues / 2; ++pair) {
      const int gate = 8 * (pair / 4) + pair % 4;
      const float expected = numerics::swiglu(in[gate], in[gate + 4]);
      uint32_t expected_bits, actual_bits;
      std::memcpy(&expected_bits, &expected, 4);
      std::memcpy(&actual_bits, &out[gate], 4);
      mismatches += expected_bits == actual_bits ? 0 : 1;
      ++checked;
    }
  }
  EXPECT_EQ(mismatches, 0u) << "of " << checked << " SwiGLU values";
}

}  // namespace
}  // namespace mok::gemm_test
