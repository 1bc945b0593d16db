// The mxfp8 round trips of the mxfp8 layer (runtime/mx_weights.hpp) against the quantizers'
// definition, bit for bit: mx_rows (bf16 and fp32 rows, a device row bound, a grid stride),
// mx_columns (explicit groups with gaps, empty groups and partial last blocks; offsets alone;
// uniform groups; gate/up groups; in place) and both copies of MxWeightCache. Every output is
// poisoned two ways before each run; the rows outside the bound or the groups must still hold the
// poison afterwards (in place: the input).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

#include "cpu/quantize_cases.hpp"
#include "device_buffer.hpp"
#include "mok/cuda_check.hpp"
#include "mok/detail/fp8_numerics.hpp"
#include "mok/gemm.hpp"
#include "mok/quantize.hpp"
#include "runtime/device_memory.hpp"
#include "runtime/mx_weights.hpp"

namespace mok::quantize_test {
namespace {

using ::mok::testing::DeviceBuffer;

// Skips the test unless an sm_90 GPU is present (the kernels are built for sm_90a).
#define MOK_REQUIRE_SM90()                                                         \
  do {                                                                             \
    int device_count_ = 0;                                                         \
    if (cudaGetDeviceCount(&device_count_) != cudaSuccess || device_count_ == 0) { \
      (void)cudaGetLastError();                                                    \
      GTEST_SKIP() << "no CUDA device: the mxfp8 round trips need an sm_90 GPU";   \
    }                                                                              \
    cudaDeviceProp prop_{};                                                        \
    MOK_CUDA_CHECK(cudaGetDeviceProperties(&prop_, 0));                            \
    if (prop_.major != 9)                                                          \
      GTEST_SKIP() << "device is sm_" << prop_.major << prop_.minor                \
                   << ", the round-trip kernels are built for sm_90a";             \
  } while (0)

// Two poisons: a NaN pattern and a finite one, so that an unwritten element shows against an
// expected NaN too.
constexpr uint8_t kPoisons[] = {0xff, 0x5a};

bf16 poison_value(uint8_t poison) {
  return bf16::from_bits(static_cast<uint16_t>(poison * 0x0101));
}

bool is_nan(bf16 value) { return (value.bits & 0x7fffu) > 0x7f80u; }

// The first element that differs, or "": equal bits, or NaN both (the GPU's bf16 conversion may
// give a NaN another sign or payload than the host's).
std::string first_mismatch(const std::vector<bf16>& got, const std::vector<bf16>& expected) {
  if (got.size() != expected.size()) return "sizes differ";
  for (size_t i = 0; i < got.size(); ++i) {
    if (got[i].bits != expected[i].bits && !(is_nan(got[i]) && is_nan(expected[i]))) {
      char text[96];
      std::snprintf(text, sizeof(text), "element %zu: gpu bits 0x%04x, expected 0x%04x", i,
                    got[i].bits, expected[i].bits);
      return text;
    }
  }
  return "";
}

// Matrices (batch, rows, cols) quantized to mxfp8 and dequantized by the CPU quantizers, as bf16
// in the input's layout: 1 x 32 blocks along the rows, or (down_the_rows) 32 x 1 blocks down the
// columns, the quantizers' transposed copy (rows a multiple of 32).
template <class Input>
std::vector<bf16> round_trip_on_host(const std::vector<Input>& x, int64_t batch, int64_t rows,
                                     int64_t cols, bool down_the_rows = false) {
  const quantize::Layout layout =
      quantize::describe(quantize::Format::kMxfp8, batch, rows, cols, 1, 32, down_the_rows);
  std::vector<uint8_t> data(layout.num_elements()), scales(layout.num_scales());
  std::vector<float> values(layout.num_elements());
  quantize::quantize_cpu(
      layout, x.data(),
      sizeof(Input) == 4 ? quantize::InputType::kFp32 : quantize::InputType::kBf16, data.data(),
      scales.data());
  quantize::dequantize_cpu(layout, data.data(), scales.data(), values.data());
  if (!down_the_rows) return to_bf16(values);
  std::vector<float> back(values.size());  // the data (batch, cols, rows) transposed back
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < cols; ++c) {
        back[(b * rows + r) * cols + c] = values[(b * cols + c) * rows + r];
      }
    }
  }
  return to_bf16(back);
}

// ---- mx_rows ------------------------------------------------------------------------------------

struct RowsCase {
  std::string name;
  int64_t rows, cols;
  int32_t bound;  // the device row bound; -1: none (every row)
};

const RowsCase kRowsCases[] = {
    {"a row bound", 300, 96, 217},
    {"every row", 77, 160, -1},
    {"a bound of 0", 40, 64, 0},
    {"a grid stride", 5000, 1024, 4999},  // more blocks than the grid's threads
};

template <class Input>
std::vector<bf16> rows_on_gpu(const std::vector<Input>& x, const RowsCase& c, uint8_t poison,
                              int num_sms) {
  DeviceBuffer<Input> input(x);
  DeviceBuffer<bf16> output(x.size());
  DeviceBuffer<int32_t> bound(std::vector<int32_t>{c.bound});
  MOK_CUDA_CHECK(cudaMemset(output.get(), poison, output.bytes()));
  mx_rows(input.get(), output.get(), c.rows, c.cols, c.bound < 0 ? nullptr : bound.get(), num_sms,
          nullptr);
  MOK_CUDA_CHECK(cudaDeviceSynchronize());
  return output.download();
}

template <class Input>
void expect_rows_match(const std::vector<Input>& x, const RowsCase& c) {
  const std::vector<bf16> round_tripped = round_trip_on_host(x, 1, c.rows, c.cols);
  const int64_t bound = c.bound < 0 ? c.rows : c.bound;
  for (const uint8_t poison : kPoisons) {
    std::vector<bf16> expected(round_tripped.begin(), round_tripped.begin() + bound * c.cols);
    expected.resize(round_tripped.size(), poison_value(poison));  // the rows past the bound
    for (const int num_sms : {current_device_sm_count(), 1}) {
      EXPECT_EQ(first_mismatch(rows_on_gpu(x, c, poison, num_sms), expected), "")
          << "poison " << int(poison) << ", " << num_sms << " SMs";
    }
  }
}

TEST(MxRoundTripGpu, RowsMatchTheQuantizersOnBf16AndFp32) {
  MOK_REQUIRE_SM90();
  uint32_t seed = 300;
  for (const RowsCase& c : kRowsCases) {
    SCOPED_TRACE(c.name);
    // Runs of 32 (one magnitude a block) and of 40 (blocks of two magnitudes).
    for (const size_t run : {size_t{32}, size_t{40}}) {
      const std::vector<float> x = random_values(c.rows * c.cols, run, seed++);
      SCOPED_TRACE("runs of " + std::to_string(run));
      {
        SCOPED_TRACE("bf16");
        expect_rows_match(to_bf16(x), c);
      }
      SCOPED_TRACE("fp32");
      expect_rows_match(x, c);
    }
  }
}

// ---- mx_columns ---------------------------------------------------------------------------------

struct GroupsCase {
  std::string name;
  int64_t rows, cols;
  std::vector<int32_t> offsets, counts;  // offsets empty: uniform groups of group_rows
  int64_t group_rows;
  int num_groups;
  bool gate_up;
};

std::vector<GroupsCase> groups_cases() {
  return {
      {"offsets and counts: gaps, an empty group, partial last blocks",
       260,
       40,
       {3, 40, 40, 120, 200},
       {33, 0, 70, 64, 5},
       0,
       5,
       false},
      {"offsets alone", 200, 264, {0, 45, 45, 140, 173}, {}, 0, 4, false},
      {"uniform groups of whole blocks", 3 * 96 + 20, 48, {}, {}, 96, 3, false},
      {"uniform groups with partial blocks", 4 * 50 + 7, 16, {}, {}, 50, 4, false},
      {"gate/up groups (I = 96)", 3 * 192 + 16, 64, {}, {}, 192, 3, true},
  };
}

// Rows [first, first + count) of `values` (row-major, cols wide) round-tripped in 32 x 1 blocks
// from `first`, the last one partial: fp8::mx_round_trip with the E8M0 code of the block's amax,
// which tests/cpu/test_mx_round_trip.cpp ties to quantize_cpu / dequantize_cpu.
void round_trip_columns(std::vector<float>& values, int64_t cols, int64_t first, int64_t count) {
  for (int64_t r0 = 0; r0 < count; r0 += 32) {
    const int64_t n = std::min<int64_t>(32, count - r0);
    for (int64_t c = 0; c < cols; ++c) {
      uint32_t amax_bits = 0;
      for (int64_t r = 0; r < n; ++r) {
        const float value = values[(first + r0 + r) * cols + c];
        amax_bits = std::max(amax_bits, fp8::finite_magnitude_bits(value));
      }
      const uint8_t code = fp8::e8m0_scale_code(float_of_bits(amax_bits));
      for (int64_t r = 0; r < n; ++r) {
        float& value = values[(first + r0 + r) * cols + c];
        value = fp8::mx_round_trip(value, code);
      }
    }
  }
}

std::vector<float> widen(const std::vector<bf16>& x) {
  std::vector<float> out(x.size());
  for (size_t i = 0; i < x.size(); ++i) out[i] = x[i].to_float();
  return out;
}

// What mx_columns writes over `base` (the poisoned output, or x itself in place). Gate/up groups
// are split into W_gate's and W_up's rows with gemm::split_gate_up, each round-tripped on its own,
// and interleaved again.
std::vector<bf16> columns_on_host(const std::vector<bf16>& x, const GroupsCase& c,
                                  std::vector<bf16> base) {
  for (int g = 0; g < c.num_groups; ++g) {
    const int64_t first = c.offsets.empty() ? g * c.group_rows : c.offsets[g];
    const int64_t count = c.offsets.empty()   ? c.group_rows
                          : !c.counts.empty() ? c.counts[g]
                                              : c.offsets[g + 1] - c.offsets[g];
    const std::vector<bf16> group(x.begin() + first * c.cols, x.begin() + (first + count) * c.cols);
    std::vector<bf16> result;
    if (c.gate_up) {
      const int64_t inter = count / 2;
      std::vector<bf16> gate, up;
      gemm::split_gate_up(group, 1, inter, c.cols, gate, up);
      std::vector<float> gate_values = widen(gate), up_values = widen(up);
      round_trip_columns(gate_values, c.cols, 0, inter);
      round_trip_columns(up_values, c.cols, 0, inter);
      result = gemm::interleave_gate_up(to_bf16(gate_values), to_bf16(up_values), 1,
                                        static_cast<int>(inter), static_cast<int>(c.cols));
    } else {
      std::vector<float> values = widen(group);
      round_trip_columns(values, c.cols, 0, count);
      result = to_bf16(values);
    }
    std::copy(result.begin(), result.end(), base.begin() + first * c.cols);
  }
  return base;
}

std::vector<bf16> columns_on_gpu(const std::vector<bf16>& x, const GroupsCase& c, bool in_place,
                                 uint8_t poison, int num_sms) {
  DeviceBuffer<bf16> input(x), output(x.size());
  DeviceBuffer<int32_t> offsets(c.offsets), counts(c.counts);
  MOK_CUDA_CHECK(cudaMemset(output.get(), poison, output.bytes()));
  quantize::MxColumnGroups groups;
  groups.offsets = c.offsets.empty() ? nullptr : offsets.get();
  groups.counts = c.counts.empty() ? nullptr : counts.get();
  groups.group_rows = c.group_rows;
  groups.num_groups = c.num_groups;
  groups.gate_up = c.gate_up;
  mx_columns(input.get(), in_place ? input.get() : output.get(), c.cols, groups, num_sms, nullptr);
  MOK_CUDA_CHECK(cudaDeviceSynchronize());
  return in_place ? input.download() : output.download();
}

TEST(MxRoundTripGpu, ColumnsMatchTheQuantizersInEveryGroupLayout) {
  MOK_REQUIRE_SM90();
  uint32_t seed = 400;
  for (const GroupsCase& c : groups_cases()) {
    SCOPED_TRACE(c.name);
    // 16 rows to a magnitude: a 32 x 1 block spans two, or more where a group starts mid-run.
    const std::vector<bf16> x = to_bf16(random_values(c.rows * c.cols, 16 * c.cols, seed++));
    for (const int num_sms : {current_device_sm_count(), 1}) {
      SCOPED_TRACE(std::to_string(num_sms) + " SMs");
      for (const uint8_t poison : kPoisons) {
        const std::vector<bf16> poisoned(x.size(), poison_value(poison));
        EXPECT_EQ(first_mismatch(columns_on_gpu(x, c, false, poison, num_sms),
                                 columns_on_host(x, c, poisoned)),
                  "")
            << "poison " << int(poison);
      }
      EXPECT_EQ(first_mismatch(columns_on_gpu(x, c, true, 0, num_sms), columns_on_host(x, c, x)),
                "")
          << "in place";
    }
  }
}

// ---- MxWeightCache ------------------------------------------------------------------------------

TEST(MxRoundTripGpu, WeightCacheCopiesAreTheQuantizersRoundTrips) {
  MOK_REQUIRE_SM90();
  const LayerShape shape{/*hidden=*/64, /*intermediate=*/96, /*shared_intermediate=*/32,
                         /*num_experts=*/3, /*top_k=*/2};
  const int64_t experts = shape.num_experts, hidden = shape.hidden, inter = shape.intermediate;
  const int64_t shared_inter = shape.shared_intermediate;
  // 8 rows to a magnitude: a 1 x 32 block has one, a 32 x 1 block four (NaN, +-Inf, zero and
  // subnormal runs among them).
  uint32_t seed = 500;
  const auto weights = [&](int64_t rows, int64_t cols) {
    return to_bf16(random_values(rows * cols, 8 * cols, seed++));
  };
  const std::vector<bf16> gate = weights(experts * inter, hidden),
                          up = weights(experts * inter, hidden),
                          down = weights(experts * hidden, inter),
                          shared_gate = weights(shared_inter, hidden),
                          shared_up = weights(shared_inter, hidden),
                          shared_down = weights(hidden, shared_inter);
  const int e = static_cast<int>(experts), i = static_cast<int>(inter);
  const int h = static_cast<int>(hidden), s = static_cast<int>(shared_inter);
  DeviceBuffer<bf16> gate_up_device(gemm::interleave_gate_up(gate, up, e, i, h)), down_device(down),
      shared_gate_up_device(gemm::interleave_gate_up(shared_gate, shared_up, 1, s, h)),
      shared_down_device(shared_down);
  const DeviceLayerWeights device_weights{gate_up_device.get(),
                                          down_device.get(),
                                          shared_gate_up_device.get(),
                                          shared_down_device.get(),
                                          static_cast<int64_t>(gate_up_device.size()),
                                          static_cast<int64_t>(down_device.size()),
                                          static_cast<int64_t>(shared_gate_up_device.size()),
                                          static_cast<int64_t>(shared_down_device.size())};
  // The host definition: the forward copy 1 x 32 along each matrix's input dimension (W_gate, W_up
  // along H, W_down along I); the dgrad copy 32 x 1 down its rows (W_gate and W_up each on its own
  // along I, W_down along H), gate/up interleaved as the bf16 weights.
  const auto gate_up_copy = [&](const std::vector<bf16>& g, const std::vector<bf16>& u, int batch,
                                int rows, bool dgrad) {
    return gemm::interleave_gate_up(round_trip_on_host(g, batch, rows, hidden, dgrad),
                                    round_trip_on_host(u, batch, rows, hidden, dgrad), batch, rows,
                                    h);
  };
  const auto download = [](const bf16* device, size_t count) {
    std::vector<bf16> host(count);
    MOK_CUDA_CHECK(cudaMemcpy(host.data(), device, count * 2, cudaMemcpyDeviceToHost));
    return host;
  };
  const auto expect_copy = [&](const DeviceLayerWeights& copy, bool dgrad) {
    SCOPED_TRACE(dgrad ? "dgrad copy" : "forward copy");
    EXPECT_EQ(first_mismatch(download(copy.gate_up, gate_up_device.size()),
                             gate_up_copy(gate, up, e, i, dgrad)),
              "")
        << "gate/up";
    EXPECT_EQ(first_mismatch(download(copy.down, down.size()),
                             round_trip_on_host(down, experts, hidden, inter, dgrad)),
              "")
        << "down";
    EXPECT_EQ(first_mismatch(download(copy.shared_gate_up, shared_gate_up_device.size()),
                             gate_up_copy(shared_gate, shared_up, 1, s, dgrad)),
              "")
        << "shared gate/up";
    EXPECT_EQ(first_mismatch(download(copy.shared_down, shared_down.size()),
                             round_trip_on_host(shared_down, 1, hidden, shared_inter, dgrad)),
              "")
        << "shared down";
  };
  for (const bool with_dgrad : {true, false}) {
    SCOPED_TRACE(with_dgrad ? "cache with the dgrad copy" : "forward copy only");
    MxWeightCache cache(shape, experts, with_dgrad);
    EXPECT_FALSE(cache.has_weights());
    ASSERT_EQ(cache.has_dgrad(), with_dgrad);
    EXPECT_EQ(cache.bytes(), (with_dgrad ? 2 : 1) * (experts * inter + shared_inter) * hidden * 6);
    for (const uint8_t poison : kPoisons) {
      for (const DeviceLayerWeights* copy : {&cache.forward(), &cache.dgrad()}) {
        for (const auto& [memory, count] :
             {std::pair{copy->gate_up, copy->gate_up_elements},
              std::pair{copy->down, copy->down_elements},
              std::pair{copy->shared_gate_up, copy->shared_gate_up_elements},
              std::pair{copy->shared_down, copy->shared_down_elements}}) {
          if (memory != nullptr) MOK_CUDA_CHECK(cudaMemset(memory, poison, count * 2));
        }
      }
      cache.quantize(device_weights, nullptr);
      MOK_CUDA_CHECK(cudaDeviceSynchronize());
      EXPECT_TRUE(cache.has_weights());
      SCOPED_TRACE("poison " + std::to_string(poison));
      expect_copy(cache.forward(), false);
      if (with_dgrad) expect_copy(cache.dgrad(), true);
    }
  }
}

}  // namespace
}  // namespace mok::quantize_test
