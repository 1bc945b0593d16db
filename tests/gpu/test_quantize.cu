// The GPU quantizers (mok::quantize::quantize_gpu) against the CPU definition, byte for byte: the
// hardware E4M3 conversion with its non-finite patch against encode_e4m3 on every float, then each
// variant on fresh seeded data with special values, bf16 and fp32 inputs, partial tiles and
// unaligned rows, into outputs poisoned two ways first.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "cpu/quantize_cases.hpp"
#include "device_buffer.hpp"
#include "kernels/quantize/elements.cuh"
#include "mok/cuda_check.hpp"
#include "mok/detail/fp8_numerics.hpp"
#include "mok/quantize.hpp"

namespace mok::quantize_test {
namespace {

using ::mok::testing::DeviceBuffer;
using quantize::Format;
using quantize::InputType;
using quantize::Layout;

// Skips the test unless an sm_90 GPU is present (the kernels are built for sm_90a).
#define MOK_REQUIRE_SM90()                                                         \
  do {                                                                             \
    int device_count_ = 0;                                                         \
    if (cudaGetDeviceCount(&device_count_) != cudaSuccess || device_count_ == 0) { \
      (void)cudaGetLastError();                                                    \
      GTEST_SKIP() << "no CUDA device: the quantize kernels need an sm_90 GPU";    \
    }                                                                              \
    cudaDeviceProp prop_{};                                                        \
    MOK_CUDA_CHECK(cudaGetDeviceProperties(&prop_, 0));                            \
    if (prop_.major != 9)                                                          \
      GTEST_SKIP() << "device is sm_" << prop_.major << prop_.minor                \
                   << ", the quantize kernels are built for sm_90a";               \
  } while (0)

// Every float bit pattern, four at a time through the kernels' encode_scaled (factor 1: the
// multiply is exact), against encode_e4m3 of each.
__global__ void count_encode_mismatches(unsigned long long* mismatches,
                                        uint32_t* first_mismatch_bits) {
  constexpr uint64_t kGroups = (1ull << 32) / 4;
  for (uint64_t group = blockIdx.x * static_cast<uint64_t>(blockDim.x) + threadIdx.x;
       group < kGroups; group += static_cast<uint64_t>(gridDim.x) * blockDim.x) {
    float values[4];
    for (int j = 0; j < 4; ++j) values[j] = __uint_as_float(static_cast<uint32_t>(group * 4 + j));
    uint32_t words[1];
    quantize::encode_scaled(values, 1.0f, words);
    for (int j = 0; j < 4; ++j) {
      const uint32_t hardware = (words[0] >> (8 * j)) & 0xffu;
      if (hardware != fp8::encode_e4m3(values[j])) {
        atomicAdd(mismatches, 1ull);
        atomicMin(first_mismatch_bits, __float_as_uint(values[j]));
      }
    }
  }
}

TEST(QuantizeGpu, HardwareEncodeMatchesEncodeE4M3ForEveryFloat) {
  MOK_REQUIRE_SM90();
  DeviceBuffer<unsigned long long> mismatches(1);
  DeviceBuffer<uint32_t> first(1);
  MOK_CUDA_CHECK(cudaMemset(mismatches.get(), 0, sizeof(unsigned long long)));
  MOK_CUDA_CHECK(cudaMemset(first.get(), 0xff, sizeof(uint32_t)));
  count_encode_mismatches<<<4096, 256>>>(mismatches.get(), first.get());
  MOK_CUDA_CHECK_LAUNCH();
  MOK_CUDA_CHECK(cudaDeviceSynchronize());
  EXPECT_EQ(mismatches.download()[0], 0ull)
      << "cvt.rn.satfinite.e4m3x2 + patch differs from encode_e4m3; first at float bits 0x"
      << std::hex << first.download()[0];
}

struct Case {
  std::string name;
  Format format;
  int32_t block_rows, block_cols;
  bool transposed;
  int64_t batch, rows, cols;  // the input's matrices
};

std::vector<Case> cases() {
  return {
      {"fp8 1x128", Format::kFp8, 1, 128, false, 3, 200, 384},
      {"fp8 1x128 grid-stride", Format::kFp8, 1, 128, false, 1, 4096, 1024},
      // (rowwise: a thread's kUnroll vectors a grid stride apart, the last warp half full)
      {"fp8 1x128 grid-stride, a half warp at the end", Format::kFp8, 1, 128, false, 1, 42001, 128},
      {"fp8 128x128 partial rows", Format::kFp8, 128, 128, false, 2, 200, 384},
      {"fp8 128x128 one block", Format::kFp8, 128, 128, false, 1, 128, 128},
      {"fp8 transposed partial column tile", Format::kFp8, 1, 128, true, 2, 256, 200},
      {"fp8 transposed odd columns", Format::kFp8, 1, 128, true, 1, 384, 37},
      {"mxfp8 1x32", Format::kMxfp8, 1, 32, false, 3, 200, 96},
      {"mxfp8 1x32 grid-stride", Format::kMxfp8, 1, 32, false, 1, 4096, 1024},
      {"mxfp8 1x32 two grid strides, a partial warp at the end", Format::kMxfp8, 1, 32, false, 1,
       200001, 32},
      {"mxfp8 transposed partial tiles", Format::kMxfp8, 1, 32, true, 2, 96, 200},
      {"mxfp8 transposed columns not a multiple of 8", Format::kMxfp8, 1, 32, true, 1, 160, 100},
      {"mxfp8 transposed odd columns", Format::kMxfp8, 1, 32, true, 2, 64, 37},
  };
}

struct Bytes {
  std::vector<uint8_t> data, scales;
};

template <class Input>
Bytes quantize_on_cpu(const Layout& layout, const std::vector<Input>& x, InputType type) {
  Bytes out{std::vector<uint8_t>(layout.num_elements()),
            std::vector<uint8_t>(layout.scale_bytes())};
  quantize::quantize_cpu(layout, x.data(), type, out.data.data(), out.scales.data());
  return out;
}

template <class Input>
Bytes quantize_on_gpu(const Layout& layout, const std::vector<Input>& x, InputType type,
                      int poison) {
  DeviceBuffer<Input> x_device(x);
  DeviceBuffer<uint8_t> data(layout.num_elements()), scales(layout.scale_bytes());
  MOK_CUDA_CHECK(cudaMemset(data.get(), poison, data.bytes()));
  MOK_CUDA_CHECK(cudaMemset(scales.get(), poison, scales.bytes()));
  quantize::quantize_gpu(layout, x_device.get(), type, data.get(), scales.get(), nullptr);
  MOK_CUDA_CHECK(cudaDeviceSynchronize());
  return {data.download(), scales.download()};
}

// The index and both values of the first differing byte, or "" when equal.
std::string first_difference(const std::vector<uint8_t>& gpu, const std::vector<uint8_t>& cpu) {
  if (gpu.size() != cpu.size()) return "sizes differ";
  for (size_t i = 0; i < gpu.size(); ++i) {
    if (gpu[i] != cpu[i]) {
      return "byte " + std::to_string(i) + ": gpu " + std::to_string(gpu[i]) + ", cpu " +
             std::to_string(cpu[i]);
    }
  }
  return "";
}

template <class Input>
void expect_gpu_equals_cpu(const Case& c, const std::vector<Input>& x, InputType type) {
  const Layout layout = quantize::describe(c.format, c.batch, c.rows, c.cols, c.block_rows,
                                           c.block_cols, c.transposed);
  const Bytes cpu = quantize_on_cpu(layout, x, type);
  for (int poison : {0xff, 0x00}) {
    const Bytes gpu = quantize_on_gpu(layout, x, type, poison);
    EXPECT_EQ(first_difference(gpu.data, cpu.data), "") << "data, poison " << poison;
    EXPECT_EQ(first_difference(gpu.scales, cpu.scales), "") << "scales, poison " << poison;
  }
}

TEST(QuantizeGpu, EveryVariantMatchesTheCpuBytewiseOnBf16) {
  MOK_REQUIRE_SM90();
  uint32_t seed = 100;
  for (const Case& c : cases()) {
    SCOPED_TRACE(c.name);
    const std::vector<bf16> x = to_bf16(random_values(c.batch * c.rows * c.cols, 48, seed++));
    expect_gpu_equals_cpu(c, x, InputType::kBf16);
  }
}

TEST(QuantizeGpu, EveryVariantMatchesTheCpuBytewiseOnFp32) {
  MOK_REQUIRE_SM90();
  uint32_t seed = 200;
  for (const Case& c : cases()) {
    SCOPED_TRACE(c.name);
    expect_gpu_equals_cpu(c, random_values(c.batch * c.rows * c.cols, 80, seed++),
                          InputType::kFp32);
  }
}

// Values near the block boundaries of the data: each block's amax in its last element, so a block
// split wrongly across lanes, warps or tiles changes a scale.
TEST(QuantizeGpu, AmaxInTheLastElementOfEveryBlock) {
  MOK_REQUIRE_SM90();
  for (const Case& c : cases()) {
    SCOPED_TRACE(c.name);
    std::vector<float> x(c.batch * c.rows * c.cols);
    for (size_t i = 0; i < x.size(); ++i) x[i] = 1.0f + static_cast<float>(i % 7) / 8.0f;
    const Layout layout = quantize::describe(c.format, c.batch, c.rows, c.cols, c.block_rows,
                                             c.block_cols, c.transposed);
    // the data's last column of every block and last row of every row block: a large value
    for (int64_t b = 0; b < layout.batch; ++b) {
      for (int64_t r = 0; r < layout.rows; ++r) {
        for (int64_t col = layout.block_cols - 1; col < layout.cols; col += layout.block_cols) {
          if (layout.block_rows > 1 && (r + 1) % layout.block_rows != 0 && r + 1 != layout.rows) {
            continue;
          }
          const int64_t index = b * layout.rows * layout.cols +
                                (layout.transposed ? col * layout.rows + r : r * layout.cols + col);
          x[index] = 1000.0f + static_cast<float>((r * 31 + col) % 97);
        }
      }
    }
    expect_gpu_equals_cpu(c, x, InputType::kFp32);
  }
}

TEST(QuantizeGpu, RejectsAMisalignedInput) {
  MOK_REQUIRE_SM90();
  const Layout layout = quantize::describe(Format::kMxfp8, 1, 4, 64, 1, 32, false);
  DeviceBuffer<uint16_t> x(4 * 64 + 8);
  DeviceBuffer<uint8_t> data(layout.num_elements()), scales(layout.scale_bytes());
  try {
    quantize::quantize_gpu(layout, x.get() + 1, InputType::kBf16, data.get(), scales.get(),
                           nullptr);
    ADD_FAILURE() << "no error for a pointer 2 bytes past an aligned one";
  } catch (const Error& error) {
    EXPECT_EQ(error.argument(), "x");
  }
}

}  // namespace
}  // namespace mok::quantize_test
