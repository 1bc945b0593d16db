// The FP8 blockwise-scaled grouped wgrad GEMM (mok/gemm_fp8.hpp) against an fp64 oracle on the
// same E4M3 bytes and fp32 scales and against the CPU reference's quantization of its operands
// (src/reference/quantized_engine.cpp, weight_grads): uneven and empty experts, unpadded spans,
// outputs poisoned before each run, bitwise repeats; exact and random data
// (gemm_fp8_backward_support.hpp). And both backward GEMMs' argument checks.
#include <algorithm>
#include <cmath>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "gemm_fp8_backward_support.hpp"
#include "gemm_test_support.hpp"
#include "mok/detail/fp8_numerics.hpp"
#include "mok/error.hpp"
#include "mok/gemm_fp8.hpp"
#include "mok/quantize.hpp"
#include "reference/block_scaled.hpp"

namespace mok::gemm_test {
namespace {

using namespace mok::gemm;

// ---- wgrad --------------------------------------------------------------------------------------

// dw (E, n, k) = dyᵀ · x per expert from the transposed operands dy_t (n, capacity), x_t (k,
// capacity) and their scales (features, capacity / 128). Each expert's span starts on a 128-row
// boundary.
struct WgradProblem {
  int num_experts = 0, capacity = 0, n = 0, k = 0;
  std::vector<int> offsets, counts;
  std::vector<uint8_t> dy_t, x_t;
  std::vector<float> dy_t_scales, x_t_scales;
  int row_blocks() const { return capacity / kBlock; }
};

// spans: each expert's span (a multiple of 128 except possibly the last); counts <= spans. The
// capacity adds one spare block past the last expert.
WgradProblem wgrad_layout(int n, int k, const std::vector<int>& counts,
                          const std::vector<int>& spans) {
  WgradProblem p;
  p.n = n;
  p.k = k;
  p.num_experts = static_cast<int>(counts.size());
  p.counts = counts;
  p.offsets.assign(p.num_experts + 1, 0);
  for (int e = 0; e < p.num_experts; ++e) p.offsets[e + 1] = p.offsets[e] + spans[e];
  p.capacity = (p.offsets.back() + kBlock - 1) / kBlock * kBlock + kBlock;
  return p;
}

// The tile-padded layout of the layer: each expert's count rounded up to 128.
WgradProblem padded_wgrad_layout(int n, int k, const std::vector<int>& counts) {
  std::vector<int> spans(counts.size());
  for (size_t e = 0; e < counts.size(); ++e) spans[e] = (counts[e] + kBlock - 1) / kBlock * kBlock;
  return wgrad_layout(n, k, counts, spans);
}

const std::vector<int> kWgradRows = {0, 1, 127, 128, 129, 300, 0, 200, 64};

bool is_expert_row(const WgradProblem& p, int row) {
  for (int e = 0; e < p.num_experts; ++e) {
    if (row >= p.offsets[e] && row < p.offsets[e] + p.counts[e]) return true;
  }
  return false;
}

// Exact data; every byte outside the experts' rows (padding and the spare rows) an E4M3 NaN,
// which the GEMM must never sum.
void fill_exact_wgrad(WgradProblem& p, uint32_t seed) {
  std::mt19937 generator(seed);
  std::uniform_int_distribution<int> integer(-4, 4), exponent(-2, 2);
  const auto fill = [&](std::vector<uint8_t>& codes, std::vector<float>& scales, int features) {
    codes.assign(static_cast<size_t>(features) * p.capacity, kE4m3Nan);
    for (int f = 0; f < features; ++f) {
      for (int row = 0; row < p.capacity; ++row) {
        if (is_expert_row(p, row)) {
          codes[static_cast<size_t>(f) * p.capacity + row] =
              fp8::encode_e4m3(static_cast<float>(integer(generator)));
        }
      }
    }
    scales.resize(static_cast<size_t>(features) * p.row_blocks());
    for (auto& v : scales) v = std::ldexp(1.0f, exponent(generator));
  };
  fill(p.dy_t, p.dy_t_scales, p.n);
  fill(p.x_t, p.x_t_scales, p.k);
}

// fp64 oracle (value, S) of dw from the quantized operands, from `start` (main_grad or zero).
struct WgradOracle {
  std::vector<double> dw, magnitude;
  WgradOracle(const WgradProblem& p, const std::vector<float>& start) {
    const size_t count = static_cast<size_t>(p.num_experts) * p.n * p.k;
    dw.assign(count, 0.0);
    magnitude.assign(count, 0.0);
    const std::vector<double> a = decode_all(p.dy_t), b = decode_all(p.x_t);
    for (int e = 0; e < p.num_experts; ++e) {
      const int begin = p.offsets[e], end = p.offsets[e] + p.counts[e];
      for (int i = 0; i < p.n; ++i) {
        for (int j = 0; j < p.k; ++j) {
          const size_t index = (static_cast<size_t>(e) * p.n + i) * p.k + j;
          double sum = start.empty() ? 0.0 : start[index], sum_abs = 0.0;
          for (int block_begin = begin; block_begin < end; block_begin += kBlock) {
            const int rb = block_begin / kBlock;
            const double scale =
                static_cast<double>(p.dy_t_scales[static_cast<size_t>(i) * p.row_blocks() + rb]) *
                p.x_t_scales[static_cast<size_t>(j) * p.row_blocks() + rb];
            double block = 0.0, block_abs = 0.0;
            for (int r = block_begin; r < std::min(block_begin + kBlock, end); ++r) {
              const double product = a[static_cast<size_t>(i) * p.capacity + r] *
                                     b[static_cast<size_t>(j) * p.capacity + r];
              block += product;
              block_abs += std::abs(product);
            }
            sum += scale * block;
            sum_abs += std::abs(scale) * block_abs;
          }
          dw[index] = sum;
          magnitude[index] = sum_abs;
        }
      }
    }
  }
};

class GroupedGemmFp8Wgrad : public ::testing::Test {
 protected:
  void SetUp() override { MOK_REQUIRE_HOPPER(); }

  void upload(const WgradProblem& p) {
    dy_t_ = std::make_unique<DeviceBuffer<uint8_t>>(p.dy_t);
    x_t_ = std::make_unique<DeviceBuffer<uint8_t>>(p.x_t);
    dy_t_scales_ = std::make_unique<DeviceBuffer<float>>(p.dy_t_scales);
    x_t_scales_ = std::make_unique<DeviceBuffer<float>>(p.x_t_scales);
    offsets_ = std::make_unique<DeviceBuffer<int>>(p.offsets);
    counts_ = std::make_unique<DeviceBuffer<int>>(p.counts);
  }

  // kFp32 / kBf16 into a poisoned dw; kAccumulateFp32 into a copy of main_grad.
  template <class T>
  std::vector<T> run(const WgradProblem& p, WgradOutput output, bool with_counts, int num_sms = 0,
                     const std::vector<float>* main_grad = nullptr) {
    DeviceBuffer<T> dw(static_cast<size_t>(p.num_experts) * p.n * p.k);
    if constexpr (std::is_same_v<T, float>) {
      if (output == WgradOutput::kAccumulateFp32) {
        dw.upload(*main_grad);
      } else {
        dw.poison();
      }
    } else {
      dw.poison();
    }
    GroupedShape shape{p.num_experts, p.capacity, p.n, p.k};
    if (with_counts) shape.expert_counts = counts_->get();
    grouped_wgrad_fp8(shape, dy_t_->get(), dy_t_scales_->get(), x_t_->get(), x_t_scales_->get(),
                      offsets_->get(), dw.get(), output, nullptr, LaunchOptions{num_sms});
    MOK_CUDA_CHECK(cudaDeviceSynchronize());
    return dw.download();
  }

  std::unique_ptr<DeviceBuffer<uint8_t>> dy_t_, x_t_;
  std::unique_ptr<DeviceBuffer<float>> dy_t_scales_, x_t_scales_;
  std::unique_ptr<DeviceBuffer<int>> offsets_, counts_;
};

// Exact data with NaN bytes in every row no expert owns (padding, spare): fp32 and accumulate
// bitwise the oracle, bf16 the oracle rounded once; empty experts zero (or main_grad untouched).
// n = 200: a partial m-block; k = 272: a partial 256-column tile.
TEST_F(GroupedGemmFp8Wgrad, ExactDataBitwiseOracle) {
  WgradProblem p = padded_wgrad_layout(200, 272, kWgradRows);
  fill_exact_wgrad(p, 31);
  upload(p);
  std::mt19937 generator(32);
  std::uniform_int_distribution<int> integer(-1000, 1000);
  std::vector<float> main_grad(static_cast<size_t>(p.num_experts) * p.n * p.k);
  for (auto& v : main_grad) v = std::ldexp(static_cast<float>(integer(generator)), -4);
  const WgradOracle oracle(p, {});
  const WgradOracle accumulated(p, main_grad);
  const auto dw32 = run<float>(p, WgradOutput::kFp32, true);
  const auto dw16 = run<bf16>(p, WgradOutput::kBf16, true);
  const auto acc = run<float>(p, WgradOutput::kAccumulateFp32, true, 0, &main_grad);
  size_t fp32_mismatches = 0, bf16_mismatches = 0, accumulate_mismatches = 0;
  for (size_t i = 0; i < dw32.size(); ++i) {
    const float expected = static_cast<float>(oracle.dw[i]);
    const float expected_acc = static_cast<float>(accumulated.dw[i]);
    ASSERT_EQ(static_cast<double>(expected), oracle.dw[i]) << "exact data is not exact in fp32";
    ASSERT_EQ(static_cast<double>(expected_acc), accumulated.dw[i]) << "not exact in fp32";
    fp32_mismatches += fp8::float_to_bits(dw32[i]) == fp8::float_to_bits(expected) ? 0 : 1;
    bf16_mismatches += dw16[i].bits == bf16(expected).bits ? 0 : 1;
    accumulate_mismatches += fp8::float_to_bits(acc[i]) == fp8::float_to_bits(expected_acc) ? 0 : 1;
  }
  EXPECT_EQ(fp32_mismatches, 0u) << "fp32 outputs differing from the exact oracle";
  EXPECT_EQ(bf16_mismatches, 0u) << "bf16 outputs differing from bf16(oracle)";
  EXPECT_EQ(accumulate_mismatches, 0u) << "main_grad + dW differing from the exact oracle";
  // Each k-block in its own grid order changes nothing.
  EXPECT_TRUE(bitwise_equal(acc, run<float>(p, WgradOutput::kAccumulateFp32, true, 5, &main_grad)))
      << "accumulate: a grid of 5 CTAs differs";
}

// Experts without counts: spans of whole blocks except the last expert's (77 rows), whose last
// block ends inside the tensor among NaN bytes, as does every span past offsets[E].
TEST_F(GroupedGemmFp8Wgrad, ExactDataUnpaddedSpans) {
  const std::vector<int> counts = {128, 0, 256, 384, 77};
  WgradProblem p = wgrad_layout(136, 264, counts, counts);
  fill_exact_wgrad(p, 33);
  upload(p);
  const WgradOracle oracle(p, {});
  const auto dw32 = run<float>(p, WgradOutput::kFp32, false);
  size_t mismatches = 0;
  for (size_t i = 0; i < dw32.size(); ++i) {
    const float expected = static_cast<float>(oracle.dw[i]);
    mismatches += fp8::float_to_bits(dw32[i]) == fp8::float_to_bits(expected) ? 0 : 1;
  }
  EXPECT_EQ(mismatches, 0u) << "fp32 outputs differing from the exact oracle";
  EXPECT_TRUE(bitwise_equal(dw32, run<float>(p, WgradOutput::kFp32, true)))
      << "with expert_counts (the same rows) differs";
}

// bf16 inputs (zero padding rows, as the layer's padded layout has them) quantized by
// quantize_cpu's transposed 1 x 128 layout: the same bytes and scales as the CPU reference's
// per-expert quantization of the weight-gradient operands; the result within the derived bound of
// fp64 on those operands, no worse against fp64 on the bf16 inputs than rowwise scaling per
// expert and feature; bitwise repeatable across runs and grids.
TEST_F(GroupedGemmFp8Wgrad, RandomDataMatchesReferenceRecipe) {
  WgradProblem p = padded_wgrad_layout(200, 272, kWgradRows);
  std::vector<float> dy = random_values(p.capacity, p.n, 41, 1e-3f, kBlock);  // (capacity, n)
  std::vector<float> x = random_values(p.capacity, p.k, 42, 1.0f, kBlock);    // (capacity, k)
  for (int row = 0; row < p.capacity; ++row) {
    if (is_expert_row(p, row)) continue;
    std::fill_n(dy.begin() + static_cast<size_t>(row) * p.n, p.n, 0.0f);
    std::fill_n(x.begin() + static_cast<size_t>(row) * p.k, p.k, 0.0f);
  }
  using quantize::describe;
  using quantize::Format;
  const quantize::Layout dy_layout = describe(Format::kFp8, 1, p.capacity, p.n, 1, kBlock, true);
  const quantize::Layout x_layout = describe(Format::kFp8, 1, p.capacity, p.k, 1, kBlock, true);
  p.dy_t.resize(dy_layout.num_elements());
  p.dy_t_scales.resize(dy_layout.num_scales());
  p.x_t.resize(x_layout.num_elements());
  p.x_t_scales.resize(x_layout.num_scales());
  quantize::quantize_cpu(dy_layout, dy.data(), quantize::InputType::kFp32, p.dy_t.data(),
                         p.dy_t_scales.data());
  quantize::quantize_cpu(x_layout, x.data(), quantize::InputType::kFp32, p.x_t.data(),
                         p.x_t_scales.data());
  upload(p);

  // The CPU reference's operands (weight_grads): per expert, (features, count) transposed copies
  // of its rows only, quantized 1 x 128 along them.
  const reference::BlockScaling along_rows{quantize::Format::kFp8, 1, kBlock};
  const reference::BlockScaling rowwise{quantize::Format::kFp8, 1, 0};
  struct ExpertOperands {
    std::vector<float> dy_t, x_t;
    reference::QuantizedMatrix dy_q, x_q, dy_rowwise, x_rowwise;
  };
  std::vector<ExpertOperands> experts(p.num_experts);
  size_t operand_mismatches = 0;
  for (int e = 0; e < p.num_experts; ++e) {
    const int count = p.counts[e], begin = p.offsets[e];
    if (count == 0) continue;
    ExpertOperands& ops = experts[e];
    ops.dy_t.resize(static_cast<size_t>(p.n) * count);
    ops.x_t.resize(static_cast<size_t>(p.k) * count);
    for (int r = 0; r < count; ++r) {
      for (int i = 0; i < p.n; ++i) {
        ops.dy_t[static_cast<size_t>(i) * count + r] = dy[static_cast<size_t>(begin + r) * p.n + i];
      }
      for (int j = 0; j < p.k; ++j) {
        ops.x_t[static_cast<size_t>(j) * count + r] = x[static_cast<size_t>(begin + r) * p.k + j];
      }
    }
    ops.dy_q = reference::quantize_matrix(along_rows, ops.dy_t.data(), p.n, count);
    ops.x_q = reference::quantize_matrix(along_rows, ops.x_t.data(), p.k, count);
    ops.dy_rowwise = reference::quantize_matrix(rowwise, ops.dy_t.data(), p.n, count);
    ops.x_rowwise = reference::quantize_matrix(rowwise, ops.x_t.data(), p.k, count);
    const auto compare = [&](const reference::QuantizedMatrix& q, const std::vector<uint8_t>& codes,
                             const std::vector<float>& scales, int features) {
      for (int f = 0; f < features; ++f) {
        for (int r = 0; r < count; ++r) {
          operand_mismatches += q.codes[static_cast<size_t>(f) * count + r] ==
                                        codes[static_cast<size_t>(f) * p.capacity + begin + r]
                                    ? 0
                                    : 1;
        }
        for (int kb = 0; kb < q.num_k_blocks(); ++kb) {
          operand_mismatches +=
              q.scale(f, kb) ==
                      scales[static_cast<size_t>(f) * p.row_blocks() + begin / kBlock + kb]
                  ? 0
                  : 1;
        }
      }
    };
    compare(ops.dy_q, p.dy_t, p.dy_t_scales, p.n);
    compare(ops.x_q, p.x_t, p.x_t_scales, p.k);
  }
  EXPECT_EQ(operand_mismatches, 0u)
      << "the transposed quantization differs from the CPU reference's per-expert operands";

  std::mt19937 generator(43);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> main_grad(static_cast<size_t>(p.num_experts) * p.n * p.k);
  for (auto& v : main_grad) v = 0.01f * normal(generator);
  const auto dw32 = run<float>(p, WgradOutput::kFp32, true);
  const auto dw16 = run<bf16>(p, WgradOutput::kBf16, true);
  const auto acc = run<float>(p, WgradOutput::kAccumulateFp32, true, 0, &main_grad);

  double worst_fp32 = 0.0, worst_bf16 = 0.0, worst_acc = 0.0, worst_vs_reference = 0.0;
  size_t nonfinite = 0, empty_errors = 0;
  InputError mok_error, rowwise_error;
  for (int e = 0; e < p.num_experts; ++e) {
    const ExpertOperands& ops = experts[e];
    for (int i = 0; i < p.n; ++i) {
      for (int j = 0; j < p.k; ++j) {
        const size_t index = (static_cast<size_t>(e) * p.n + i) * p.k + j;
        if (p.counts[e] == 0) {
          empty_errors += (dw32[index] == 0.0f && dw16[index].to_float() == 0.0f &&
                           fp8::float_to_bits(acc[index]) == fp8::float_to_bits(main_grad[index]))
                              ? 0
                              : 1;
          continue;
        }
        if (!std::isfinite(dw32[index]) || !std::isfinite(acc[index])) ++nonfinite;
        const double oracle = reference::block_scaled_dot<double>(ops.dy_q, i, ops.x_q, j);
        const float cpu = reference::block_scaled_dot<float>(ops.dy_q, i, ops.x_q, j);
        const double oracle_acc =
            reference::block_scaled_dot<double>(ops.dy_q, i, ops.x_q, j, main_grad[index]);
        double s = 0.0, exact = 0.0, exact_abs = 0.0;
        for (int r = 0; r < p.counts[e]; ++r) {
          const int kb = r / kBlock;
          s += std::abs(
              static_cast<double>(ops.dy_q.values[static_cast<size_t>(i) * p.counts[e] + r]) *
              ops.x_q.values[static_cast<size_t>(j) * p.counts[e] + r] * ops.dy_q.scale(i, kb) *
              ops.x_q.scale(j, kb));
          const double product =
              static_cast<double>(ops.dy_t[static_cast<size_t>(i) * p.counts[e] + r]) *
              ops.x_t[static_cast<size_t>(j) * p.counts[e] + r];
          exact += product;
          exact_abs += std::abs(product);
        }
        s = std::max(s, 1e-300);
        worst_fp32 = std::max(worst_fp32, std::abs(dw32[index] - oracle) / s);
        worst_vs_reference = std::max(worst_vs_reference, std::abs(dw32[index] - double(cpu)) / s);
        // Accumulate: the sum's error plus a few roundings of main_grad's size.
        worst_acc = std::max(worst_acc, std::max(0.0, std::abs(acc[index] - oracle_acc) -
                                                          0x1p-22 * std::abs(main_grad[index])) /
                                            s);
        const double bf16_value = dw16[index].to_float();
        worst_bf16 =
            std::max(worst_bf16,
                     std::max(0.0, std::abs(bf16_value - oracle) -
                                       0x1p-8 * std::max(std::abs(oracle), std::abs(bf16_value))) /
                         s);
        mok_error.add(dw32[index], exact, exact_abs);
        rowwise_error.add(reference::block_scaled_dot<double>(ops.dy_rowwise, i, ops.x_rowwise, j),
                          exact, exact_abs);
      }
    }
  }
  std::cout << "[ accuracy ] fp8 wgrad: max |dw - fp64(quantized)| / S = " << worst_fp32
            << " (bound " << kBlockSumTolerance << "), vs the CPU reference (fp32) "
            << worst_vs_reference << ", accumulate " << worst_acc << ", bf16 beyond its rounding "
            << worst_bf16 << "; vs fp64 on the bf16 inputs: blockwise max " << mok_error.max
            << " rms " << mok_error.rms() << ", rowwise max " << rowwise_error.max << " rms "
            << rowwise_error.rms() << "\n";
  EXPECT_EQ(nonfinite, 0u) << "non-finite results";
  EXPECT_EQ(empty_errors, 0u) << "an expert without rows: dw not zero or main_grad changed";
  EXPECT_LE(worst_fp32, kBlockSumTolerance) << "fp32 output beyond the derived bound";
  EXPECT_LE(worst_vs_reference, 2 * kBlockSumTolerance) << "fp32 output far from the reference";
  EXPECT_LE(worst_acc, kBlockSumTolerance) << "accumulated output beyond the derived bound";
  EXPECT_LE(worst_bf16, kBlockSumTolerance) << "bf16 output beyond the derived bound";
  EXPECT_LE(mok_error.max, kRowwiseFactor * rowwise_error.max) << "worse than rowwise (max)";
  EXPECT_LE(mok_error.rms(), rowwise_error.rms()) << "worse than rowwise scaling (rms)";

  EXPECT_TRUE(bitwise_equal(dw32, run<float>(p, WgradOutput::kFp32, true)))
      << "fp32: repeated runs differ";
  EXPECT_TRUE(bitwise_equal(dw32, run<float>(p, WgradOutput::kFp32, false)))
      << "fp32: without expert_counts (zero padding rows summed) differs";
  for (int num_sms : {1, 3, 7}) {
    EXPECT_TRUE(bitwise_equal(dw16, run<bf16>(p, WgradOutput::kBf16, true, num_sms)))
        << "bf16: a grid of " << num_sms << " CTAs differs from the full grid";
    EXPECT_TRUE(bitwise_equal(dw32, run<float>(p, WgradOutput::kFp32, true, num_sms)))
        << "fp32: a grid of " << num_sms << " CTAs differs from the full grid";
    EXPECT_TRUE(
        bitwise_equal(acc, run<float>(p, WgradOutput::kAccumulateFp32, true, num_sms, &main_grad)))
        << "accumulate: a grid of " << num_sms << " CTAs differs from the full grid";
  }
}

// Host stand-ins for the argument checks, which run before anything is launched (no GPU needed).
alignas(16) uint8_t bytes[64];
alignas(16) float scales[16];
alignas(16) float output[16];
const int offsets[2] = {0, 1};

TEST(GroupedGemmFp8BackwardArguments, RejectsBadShapesAndPointers) {
  const auto dgrad = [](GroupedShape shape, const uint8_t* w_t = bytes) {
    grouped_dgrad_fp8(shape, bytes, scales, w_t, scales, offsets, output, DgradOutput::kBf16,
                      nullptr);
  };
  EXPECT_THROW(dgrad({1, 1, 100, 128}), Error);  // n (the dgrad's K) not a multiple of 128
  EXPECT_THROW(dgrad({1, 1, 128, 12}), Error);   // k not a multiple of 8
  EXPECT_THROW(dgrad({1, 1, 128, 128}, bytes + 1), Error);
  const auto wgrad = [](GroupedShape shape, const float* x_t_scales = scales) {
    grouped_wgrad_fp8(shape, bytes, scales, bytes, x_t_scales, offsets, output,
                      WgradOutput::kAccumulateFp32, nullptr);
  };
  EXPECT_THROW(wgrad({1, 100, 128, 128}), Error);  // capacity not a multiple of 128
  EXPECT_THROW(wgrad({1, 128, 12, 128}), Error);   // n not a multiple of 8
  EXPECT_THROW(wgrad({1, 128, 128, 0}), Error);
  EXPECT_THROW(wgrad({1, 128, 128, 128}, nullptr), Error);
  try {
    dgrad({1, 1, 100, 128});
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("shape.n"), std::string::npos) << error.what();
  }
  try {
    wgrad({1, 128, 128, 128}, nullptr);
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("x_t_scales"), std::string::npos) << error.what();
  }
}

}  // namespace
}  // namespace mok::gemm_test
