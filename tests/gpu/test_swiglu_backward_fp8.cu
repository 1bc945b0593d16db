// The fp8 layer's SwiGLU backward kernel (megakernel/swiglu_backward_fp8.cuh) byte for byte
// against its definition on the CPU: d_a, d_b and w·h from numerics::swiglu_backward in fp32, then
// quantize_cpu's 1 x 128 rows of (d_a | d_b) and its 128 x 1 blocks of both (d_a | d_b), to the
// gate/up gradient's 8-interleaved rows, and w·h. Fresh seeded data over two 128-row blocks (the
// second partly past the group's count, whose rows read as zeros) and two column blocks, finite
// and with NaN and ±Inf in some blocks (the kernel's general path), into poisoned outputs.
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "device_buffer.hpp"
#include "gemm_test_support.hpp"
#include "kernels/megakernel/swiglu_backward_fp8.cuh"
#include "mok/bf16.hpp"
#include "mok/cuda_check.hpp"
#include "mok/detail/numerics.hpp"
#include "mok/quantize.hpp"

namespace mok::swiglu_backward_fp8_test {
namespace {

using ::mok::testing::DeviceBuffer;

constexpr int64_t kInter = 256;       // I: two column blocks
constexpr int64_t kPaddedRows = 256;  // two 128-row blocks
constexpr int64_t kCount = 200;       // the group's rows; 200 .. 255 read as zeros

__global__ void __launch_bounds__(megakernel::kSwiGluBackwardFp8Threads, 1)
    swiglu_backward_fp8_test_kernel(megakernel::SwiGluBackwardFp8Rows rows) {
  extern __shared__ float4 staged[];
  megakernel::swiglu_backward_fp8_shared(rows, reinterpret_cast<float*>(staged));
}

struct Case {
  std::vector<bf16> gate_up;  // (rows, 2I), gate/up interleaved in blocks of 128
  std::vector<float> grad;    // (rows, I)
};

Case make_case(uint32_t seed, bool special) {
  std::mt19937 generator(seed);
  std::uniform_real_distribution<float> uniform(-4.0f, 4.0f);
  Case c{std::vector<bf16>(kPaddedRows * 2 * kInter), std::vector<float>(kPaddedRows * kInter)};
  for (auto& value : c.gate_up) value = bf16(uniform(generator));
  for (auto& value : c.grad) value = uniform(generator) * 0.25f;
  if (special) {
    const float inf = std::numeric_limits<float>::infinity();
    c.grad[3 * kInter + 5] = std::numeric_limits<float>::quiet_NaN();  // column block 0
    c.gate_up[7 * 2 * kInter + 256 + 3] = bf16(inf);     // gate, column block 1 (col 131)
    c.gate_up[150 * 2 * kInter + 128 + 9] = bf16(-inf);  // up, column block 0, row block 1
    c.grad[160 * kInter + 200] = -inf;                   // column block 1, row block 1
  }
  return c;
}

struct Outputs {
  std::vector<uint8_t> codes;     // (rows, 2I)
  std::vector<float> scales;      // (rows, 2I / 128)
  std::vector<uint8_t> codes_t;   // (2I, padded_rows), rows by quantize::GateUp8Columns
  std::vector<float> scales_t;    // (2I, padded_rows / 128)
  std::vector<uint8_t> hidden_t;  // (I, padded_rows)
  std::vector<float> hidden_scales_t;
};

// The definition: fp32 values from numerics, quantized by quantize_cpu.
Outputs expected(const Case& c) {
  std::vector<float> d_gate_up(kPaddedRows * 2 * kInter, 0.0f), hidden(kPaddedRows * kInter, 0.0f);
  for (int64_t row = 0; row < kCount; ++row) {
    for (int64_t col = 0; col < kInter; ++col) {
      const int64_t block = col / 128, within = col % 128;
      const float gate = c.gate_up[row * 2 * kInter + block * 256 + within].to_float();
      const float up = c.gate_up[row * 2 * kInter + block * 256 + 128 + within].to_float();
      const float g = c.grad[row * kInter + col];
      const float h = numerics::swiglu(gate, up);
      const numerics::SwiGluGrad d = numerics::swiglu_backward(gate, up, numerics::mul_rn(1.0f, g));
      d_gate_up[row * 2 * kInter + col] = d.d_gate;
      d_gate_up[row * 2 * kInter + kInter + col] = d.d_up;
      hidden[row * kInter + col] = numerics::mul_rn(1.0f, h);
    }
  }
  using quantize::Format;
  using quantize::InputType;
  Outputs out;
  const quantize::Layout rows =
      quantize::describe(Format::kFp8, 1, kPaddedRows, 2 * kInter, 1, 128, false);
  out.codes.resize(rows.num_elements());
  out.scales.resize(rows.num_scales());
  quantize::quantize_cpu(rows, d_gate_up.data(), InputType::kFp32, out.codes.data(),
                         out.scales.data());
  const quantize::Layout columns =
      quantize::describe(Format::kFp8, 1, kPaddedRows, 2 * kInter, 1, 128, true);
  std::vector<uint8_t> natural(columns.num_elements());
  std::vector<float> natural_scales(columns.num_scales());
  quantize::quantize_cpu(columns, d_gate_up.data(), InputType::kFp32, natural.data(),
                         natural_scales.data());
  out.codes_t.resize(natural.size());
  out.scales_t.resize(natural_scales.size());
  for (int64_t col = 0; col < 2 * kInter; ++col) {  // to the gradient's interleaved rows
    const int64_t to = quantize::GateUp8Columns{kInter}(col);
    for (int64_t r = 0; r < kPaddedRows; ++r) {
      out.codes_t[to * kPaddedRows + r] = natural[col * kPaddedRows + r];
    }
    for (int64_t b = 0; b < kPaddedRows / 128; ++b) {
      out.scales_t[to * (kPaddedRows / 128) + b] = natural_scales[col * (kPaddedRows / 128) + b];
    }
  }
  const quantize::Layout hidden_columns =
      quantize::describe(Format::kFp8, 1, kPaddedRows, kInter, 1, 128, true);
  out.hidden_t.resize(hidden_columns.num_elements());
  out.hidden_scales_t.resize(hidden_columns.num_scales());
  quantize::quantize_cpu(hidden_columns, hidden.data(), InputType::kFp32, out.hidden_t.data(),
                         out.hidden_scales_t.data());
  return out;
}

Outputs run_gpu(const Case& c) {
  DeviceBuffer<bf16> gate_up(c.gate_up);
  DeviceBuffer<float> grad(c.grad);
  DeviceBuffer<uint8_t> codes(kPaddedRows * 2 * kInter), codes_t(2 * kInter * kPaddedRows),
      hidden_t(kInter * kPaddedRows);
  DeviceBuffer<float> scales(kPaddedRows * 2 * kInter / 128),
      scales_t(2 * kInter * kPaddedRows / 128), hidden_scales_t(kInter * kPaddedRows / 128);
  for (auto* buffer : {&codes, &codes_t, &hidden_t}) buffer->poison();
  for (auto* buffer : {&scales, &scales_t, &hidden_scales_t}) buffer->poison();
  DeviceBuffer<int32_t> offsets(std::vector<int32_t>{0, static_cast<int32_t>(kPaddedRows)});
  DeviceBuffer<int32_t> counts(std::vector<int32_t>{static_cast<int32_t>(kCount)});
  megakernel::SwiGluBackwardFp8Rows rows{};
  rows.gate_up = reinterpret_cast<const __nv_bfloat16*>(gate_up.get());
  rows.saved_by_source = false;
  rows.grad_hidden = grad.get();
  rows.d_gate_up_codes = codes.get();
  rows.d_gate_up_scales = scales.get();
  rows.d_gate_up_t = codes_t.get();
  rows.d_gate_up_t_scales = scales_t.get();
  rows.hidden_t = hidden_t.get();
  rows.hidden_t_scales = hidden_scales_t.get();
  rows.padded_rows = kPaddedRows;
  rows.intermediate = static_cast<int>(kInter);
  rows.groups = quantize::ExpertRows{offsets.get(), counts.get(), 1};
  MOK_CUDA_CHECK(cudaFuncSetAttribute(swiglu_backward_fp8_test_kernel,
                                      cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      megakernel::kSwiGluBackwardFp8SharedBytes));
  swiglu_backward_fp8_test_kernel<<<kPaddedRows / megakernel::kSwiGluFp8Block,
                                    megakernel::kSwiGluBackwardFp8Threads,
                                    megakernel::kSwiGluBackwardFp8SharedBytes>>>(rows);
  MOK_CUDA_CHECK(cudaGetLastError());
  MOK_CUDA_CHECK(cudaDeviceSynchronize());
  return {codes.download(),    scales.download(),   codes_t.download(),
          scales_t.download(), hidden_t.download(), hidden_scales_t.download()};
}

// E4M3 codes equal, NaN codes (0x7f, 0xff) equal whatever their sign: a NaN's sign is the
// input's, and the NaNs that arithmetic makes (Inf · 0, say) carry the sign each platform gives
// them, not one the formulas fix (the GPU's are positive, x86's negative).
bool same_code(uint8_t a, uint8_t b) {
  return a == b || ((a & 0x7f) == 0x7f && (b & 0x7f) == 0x7f);
}

int64_t code_mismatches(const std::vector<uint8_t>& gpu, const std::vector<uint8_t>& cpu) {
  int64_t mismatches = 0;
  for (size_t i = 0; i < cpu.size(); ++i) mismatches += !same_code(gpu[i], cpu[i]);
  return mismatches;
}

// The codes (as same_code) and the scales bit for bit; rows past the count in the 1 x 128 output
// are never written (the poison stays).
void expect_same(const Outputs& gpu, const Outputs& cpu) {
  int64_t mismatches = 0;
  for (int64_t row = 0; row < kCount; ++row) {
    for (int64_t col = 0; col < 2 * kInter; ++col) {
      mismatches +=
          !same_code(gpu.codes[row * 2 * kInter + col], cpu.codes[row * 2 * kInter + col]);
    }
    for (int64_t b = 0; b < 2 * kInter / 128; ++b) {
      const int64_t i = row * (2 * kInter / 128) + b;
      mismatches += std::memcmp(&gpu.scales[i], &cpu.scales[i], sizeof(float)) != 0;
    }
  }
  EXPECT_EQ(mismatches, 0) << "1 x 128 rows of (d_a | d_b)";
  EXPECT_EQ(code_mismatches(gpu.codes_t, cpu.codes_t), 0) << "128 x 1 blocks of (d_a | d_b)";
  EXPECT_EQ(
      0, std::memcmp(gpu.scales_t.data(), cpu.scales_t.data(), cpu.scales_t.size() * sizeof(float)))
      << "their scales";
  EXPECT_EQ(code_mismatches(gpu.hidden_t, cpu.hidden_t), 0) << "128 x 1 blocks of w·h";
  EXPECT_EQ(0, std::memcmp(gpu.hidden_scales_t.data(), cpu.hidden_scales_t.data(),
                           cpu.hidden_scales_t.size() * sizeof(float)))
      << "their scales";
}

TEST(SwiGluBackwardFp8, FiniteInputsGiveTheQuantizersBytes) {
  MOK_REQUIRE_HOPPER();
  for (uint32_t seed : {11u, 12u}) {
    SCOPED_TRACE(seed);
    const Case c = make_case(seed, /*special=*/false);
    expect_same(run_gpu(c), expected(c));
  }
}

TEST(SwiGluBackwardFp8, NonFiniteInputsGiveTheQuantizersBytes) {
  MOK_REQUIRE_HOPPER();
  const Case c = make_case(13u, /*special=*/true);
  const Outputs cpu = expected(c);
  // The special values reach the outputs (else the test would not test the general path).
  int64_t nan_codes = 0;
  for (uint8_t code : cpu.codes_t) nan_codes += (code & 0x7f) == 0x7f;
  ASSERT_GT(nan_codes, 0);
  expect_same(run_gpu(c), cpu);
}

}  // namespace
}  // namespace mok::swiglu_backward_fp8_test
