// The FP8 blockwise-scaled grouped dgrad GEMM (mok/gemm_fp8.hpp) against an fp64 oracle on the
// same E4M3 bytes and fp32 scales: uneven and empty experts, a tile-padded row layout, outputs
// poisoned before each run, bitwise repeats and other grids; exact and random data
// (gemm_fp8_backward_support.hpp).
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

// ---- dgrad --------------------------------------------------------------------------------------

// dx (rows, k) = dy (rows, n) · W_e (n, k); the forward's shape (n, k) and row layout.
struct DgradProblem {
  int num_experts = 0, capacity = 0, n = 0, k = 0;
  std::vector<int> offsets, counts;
  std::vector<uint8_t> dy, w_t;              // (capacity, n), (E, k, n)
  std::vector<float> dy_scales, w_t_scales;  // (capacity, n / 128), (E, ceil(k / 128), n / 128)
  int n_blocks() const { return n / kBlock; }
  int k_blocks() const { return (k + kBlock - 1) / kBlock; }
};

const std::vector<int> kDgradRows = {0, 1, 63, 64, 65, 127, 128, 129, 300, 0, 200};

void lay_out(DgradProblem& p, int padding) {
  p.num_experts = static_cast<int>(kDgradRows.size());
  p.counts = kDgradRows;
  p.offsets.assign(p.num_experts + 1, 0);
  for (int e = 0; e < p.num_experts; ++e) {
    const int span = padding > 0 ? (p.counts[e] + padding - 1) / padding * padding : p.counts[e];
    p.offsets[e + 1] = p.offsets[e] + span;
  }
  p.capacity = p.offsets.back() + 37;
}

DgradProblem exact_dgrad(int n, int k, int padding, uint32_t seed) {
  DgradProblem p;
  p.n = n;
  p.k = k;
  lay_out(p, padding);
  std::mt19937 generator(seed);
  std::uniform_int_distribution<int> integer(-4, 4), exponent(-2, 2);
  const auto code = [&] { return fp8::encode_e4m3(static_cast<float>(integer(generator))); };
  const auto scale = [&] { return std::ldexp(1.0f, exponent(generator)); };
  p.dy.resize(static_cast<size_t>(p.capacity) * n);
  for (auto& v : p.dy) v = code();
  p.w_t.resize(static_cast<size_t>(p.num_experts) * k * n);
  for (auto& v : p.w_t) v = code();
  p.dy_scales.resize(static_cast<size_t>(p.capacity) * p.n_blocks());
  for (auto& v : p.dy_scales) v = scale();
  p.w_t_scales.resize(static_cast<size_t>(p.num_experts) * p.k_blocks() * p.n_blocks());
  for (auto& v : p.w_t_scales) v = scale();
  return p;
}

// fp64 oracle on the quantized operands (value, S) of every expert row.
struct DgradOracle {
  std::vector<double> dx, magnitude;
  std::vector<bool> written;
  explicit DgradOracle(const DgradProblem& p) {
    const size_t count = static_cast<size_t>(p.capacity) * p.k;
    dx.assign(count, 0.0);
    magnitude.assign(count, 0.0);
    written.assign(count, false);
    const std::vector<double> dy = decode_all(p.dy), w_t = decode_all(p.w_t);
    for (int e = 0; e < p.num_experts; ++e) {
      for (int row = p.offsets[e]; row < p.offsets[e] + p.counts[e]; ++row) {
        for (int j = 0; j < p.k; ++j) {
          const size_t w_row = (static_cast<size_t>(e) * p.k + j) * p.n;
          double sum = 0.0, sum_abs = 0.0;
          for (int nb = 0; nb < p.n_blocks(); ++nb) {
            const double scale =
                static_cast<double>(p.dy_scales[static_cast<size_t>(row) * p.n_blocks() + nb]) *
                p.w_t_scales[(static_cast<size_t>(e) * p.k_blocks() + j / kBlock) * p.n_blocks() +
                             nb];
            double block = 0.0, block_abs = 0.0;
            for (int i = nb * kBlock; i < (nb + 1) * kBlock; ++i) {
              const double product = dy[static_cast<size_t>(row) * p.n + i] * w_t[w_row + i];
              block += product;
              block_abs += std::abs(product);
            }
            sum += scale * block;
            sum_abs += std::abs(scale) * block_abs;
          }
          const size_t index = static_cast<size_t>(row) * p.k + j;
          dx[index] = sum;
          magnitude[index] = sum_abs;
          written[index] = true;
        }
      }
    }
  }
};

class GroupedGemmFp8Dgrad : public ::testing::Test {
 protected:
  void SetUp() override { MOK_REQUIRE_HOPPER(); }

  void upload(const DgradProblem& p) {
    dy_ = std::make_unique<DeviceBuffer<uint8_t>>(p.dy);
    w_t_ = std::make_unique<DeviceBuffer<uint8_t>>(p.w_t);
    dy_scales_ = std::make_unique<DeviceBuffer<float>>(p.dy_scales);
    w_t_scales_ = std::make_unique<DeviceBuffer<float>>(p.w_t_scales);
    offsets_ = std::make_unique<DeviceBuffer<int>>(p.offsets);
    counts_ = std::make_unique<DeviceBuffer<int>>(p.counts);
  }

  template <class T>
  std::vector<T> run(const DgradProblem& p, DgradOutput output, bool with_counts, int num_sms = 0) {
    DeviceBuffer<T> dx(static_cast<size_t>(p.capacity) * p.k);
    dx.poison();
    GroupedShape shape{p.num_experts, p.capacity, p.n, p.k};
    if (with_counts) shape.expert_counts = counts_->get();
    grouped_dgrad_fp8(shape, dy_->get(), dy_scales_->get(), w_t_->get(), w_t_scales_->get(),
                      offsets_->get(), dx.get(), output, nullptr, LaunchOptions{num_sms});
    MOK_CUDA_CHECK(cudaDeviceSynchronize());
    return dx.download();
  }

  void expect_exact(const DgradProblem& p, bool with_counts, const std::string& what) {
    upload(p);
    const DgradOracle oracle(p);
    const auto dx32 = run<float>(p, DgradOutput::kFp32, with_counts);
    const auto dx16 = run<bf16>(p, DgradOutput::kBf16, with_counts);
    size_t fp32_mismatches = 0, bf16_mismatches = 0, poison_errors = 0;
    for (size_t i = 0; i < dx32.size(); ++i) {
      if (!oracle.written[i]) {
        poison_errors += (is_poison(dx32[i]) ? 0 : 1) + (is_poison(dx16[i]) ? 0 : 1);
        continue;
      }
      const float expected = static_cast<float>(oracle.dx[i]);
      ASSERT_EQ(static_cast<double>(expected), oracle.dx[i]) << "exact data is not exact in fp32";
      fp32_mismatches += fp8::float_to_bits(dx32[i]) == fp8::float_to_bits(expected) ? 0 : 1;
      bf16_mismatches += dx16[i].bits == bf16(expected).bits ? 0 : 1;
    }
    EXPECT_EQ(fp32_mismatches, 0u) << what << ": fp32 outputs differing from the exact oracle";
    EXPECT_EQ(bf16_mismatches, 0u) << what << ": bf16 outputs differing from bf16(oracle)";
    EXPECT_EQ(poison_errors, 0u) << what << ": elements written outside the experts' rows";
  }

  std::unique_ptr<DeviceBuffer<uint8_t>> dy_, w_t_;
  std::unique_ptr<DeviceBuffer<float>> dy_scales_, w_t_scales_;
  std::unique_ptr<DeviceBuffer<int>> offsets_, counts_;
};

// n = 384: three k-blocks of the dgrad; k = 272: a full 256-column tile and a 16-column one.
TEST_F(GroupedGemmFp8Dgrad, ExactDataBitwiseOracle) {
  expect_exact(exact_dgrad(384, 272, 0, 11), false, "dgrad exact n 384 k 272");
}

TEST_F(GroupedGemmFp8Dgrad, ExactDataPaddedRows) {
  expect_exact(exact_dgrad(128, 136, 128, 12), true, "dgrad exact padded n 128 k 136");
}

// bf16 inputs quantized by quantize_cpu: dy 1 x 128 along n, the transposed weight (E, k, n) per
// 128 x 128 block — checked equal to the byte transpose of the forward weight's quantization.
TEST_F(GroupedGemmFp8Dgrad, RandomDataWithinBoundAndBitwiseRepeatable) {
  DgradProblem p;
  p.n = 1920;
  p.k = 272;
  lay_out(p, 0);
  const std::vector<float> dy = random_values(p.capacity, p.n, 21, 1.0f, 16);
  const std::vector<float> w =
      random_values(p.num_experts * p.n, p.k, 22, 0.05f, kBlock);  // (E, n, k)
  std::vector<float> w_t(w.size());                                // (E, k, n)
  for (int e = 0; e < p.num_experts; ++e) {
    for (int i = 0; i < p.n; ++i) {
      for (int j = 0; j < p.k; ++j) {
        w_t[(static_cast<size_t>(e) * p.k + j) * p.n + i] =
            w[(static_cast<size_t>(e) * p.n + i) * p.k + j];
      }
    }
  }
  using quantize::describe;
  using quantize::Format;
  const quantize::Layout dy_layout = describe(Format::kFp8, 1, p.capacity, p.n, 1, kBlock, false);
  const quantize::Layout w_t_layout =
      describe(Format::kFp8, p.num_experts, p.k, p.n, kBlock, kBlock, false);
  p.dy.resize(dy_layout.num_elements());
  p.dy_scales.resize(dy_layout.num_scales());
  p.w_t.resize(w_t_layout.num_elements());
  p.w_t_scales.resize(w_t_layout.num_scales());
  quantize::quantize_cpu(dy_layout, dy.data(), quantize::InputType::kFp32, p.dy.data(),
                         p.dy_scales.data());
  quantize::quantize_cpu(w_t_layout, w_t.data(), quantize::InputType::kFp32, p.w_t.data(),
                         p.w_t_scales.data());
  {
    // The API's equivalence: the forward's quantization (E, n, k) with bytes and scales
    // transposed (k = 272 is not a multiple of 128, so only where k's blocks are whole).
    const int whole_k = p.k / kBlock * kBlock;
    std::vector<float> w_whole(static_cast<size_t>(p.num_experts) * p.n * whole_k);
    for (size_t row = 0; row < static_cast<size_t>(p.num_experts) * p.n; ++row) {
      std::copy_n(w.begin() + row * p.k, whole_k, w_whole.begin() + row * whole_k);
    }
    const quantize::Layout w_layout =
        describe(Format::kFp8, p.num_experts, p.n, whole_k, kBlock, kBlock, false);
    std::vector<uint8_t> w_codes(w_layout.num_elements());
    std::vector<float> w_scales(w_layout.num_scales());
    quantize::quantize_cpu(w_layout, w_whole.data(), quantize::InputType::kFp32, w_codes.data(),
                           w_scales.data());
    size_t byte_mismatches = 0, scale_mismatches = 0;
    for (int e = 0; e < p.num_experts; ++e) {
      for (int j = 0; j < whole_k; ++j) {
        for (int i = 0; i < p.n; ++i) {
          byte_mismatches += p.w_t[(static_cast<size_t>(e) * p.k + j) * p.n + i] ==
                                     w_codes[(static_cast<size_t>(e) * p.n + i) * whole_k + j]
                                 ? 0
                                 : 1;
        }
      }
      for (int jb = 0; jb < whole_k / kBlock; ++jb) {
        for (int ib = 0; ib < p.n_blocks(); ++ib) {
          scale_mismatches +=
              p.w_t_scales[(static_cast<size_t>(e) * p.k_blocks() + jb) * p.n_blocks() + ib] ==
                      w_scales[(static_cast<size_t>(e) * p.n_blocks() + ib) * (whole_k / kBlock) +
                               jb]
                  ? 0
                  : 1;
        }
      }
    }
    EXPECT_EQ(byte_mismatches, 0u) << "w_t differs from the byte transpose of w's quantization";
    EXPECT_EQ(scale_mismatches, 0u) << "w_t_scales differ from w_scales transposed";
  }
  upload(p);
  const DgradOracle oracle(p);
  const auto dx32 = run<float>(p, DgradOutput::kFp32, false);
  const auto dx16 = run<bf16>(p, DgradOutput::kBf16, false);

  // Rowwise (torch-style) quantization of the same inputs, summed exactly: one scale per dy row
  // over all of n, one per row of W_eᵀ (per output column of dx).
  const reference::BlockScaling rowwise{quantize::Format::kFp8, 1, 0};
  const reference::QuantizedMatrix dy_rowwise =
      reference::quantize_matrix(rowwise, dy.data(), p.capacity, p.n);
  double worst_fp32 = 0.0, worst_bf16 = 0.0;
  size_t poison_errors = 0, nonfinite = 0;
  InputError mok_error, rowwise_error;
  for (int e = 0; e < p.num_experts; ++e) {
    const reference::QuantizedMatrix w_t_rowwise = reference::quantize_matrix(
        rowwise, w_t.data() + static_cast<size_t>(e) * p.k * p.n, p.k, p.n);
    for (int row = p.offsets[e]; row < p.offsets[e] + p.counts[e]; ++row) {
      for (int j = 0; j < p.k; ++j) {
        const size_t index = static_cast<size_t>(row) * p.k + j;
        const float* dy_row = dy.data() + static_cast<size_t>(row) * p.n;
        const float* w_row = w_t.data() + (static_cast<size_t>(e) * p.k + j) * p.n;
        double exact = 0.0, magnitude = 0.0;
        for (int i = 0; i < p.n; ++i) {
          exact += static_cast<double>(dy_row[i]) * w_row[i];
          magnitude += std::abs(static_cast<double>(dy_row[i]) * w_row[i]);
        }
        mok_error.add(dx32[index], exact, magnitude);
        rowwise_error.add(reference::block_scaled_dot<double>(dy_rowwise, row, w_t_rowwise, j),
                          exact, magnitude);
      }
    }
  }
  for (size_t i = 0; i < dx32.size(); ++i) {
    if (!oracle.written[i]) {
      poison_errors += (is_poison(dx32[i]) ? 0 : 1) + (is_poison(dx16[i]) ? 0 : 1);
      continue;
    }
    if (!std::isfinite(dx32[i]) || !std::isfinite(dx16[i].to_float())) ++nonfinite;
    const double s = std::max(oracle.magnitude[i], 1e-300);
    worst_fp32 = std::max(worst_fp32, std::abs(dx32[i] - oracle.dx[i]) / s);
    const double bf16_value = dx16[i].to_float();
    worst_bf16 = std::max(worst_bf16, std::max(0.0, std::abs(bf16_value - oracle.dx[i]) -
                                                        0x1p-8 * std::max(std::abs(oracle.dx[i]),
                                                                          std::abs(bf16_value))) /
                                          s);
  }
  std::cout << "[ accuracy ] fp8 dgrad, n = 1920: max |dx - fp64(quantized)| / S = " << worst_fp32
            << " (bound " << kBlockSumTolerance << "), bf16 beyond its rounding " << worst_bf16
            << "; vs fp64 on the bf16 inputs: blockwise max " << mok_error.max << " rms "
            << mok_error.rms() << ", rowwise max " << rowwise_error.max << " rms "
            << rowwise_error.rms() << "\n";
  EXPECT_EQ(poison_errors, 0u) << "elements written outside the experts' rows";
  EXPECT_EQ(nonfinite, 0u) << "non-finite results";
  EXPECT_LE(worst_fp32, kBlockSumTolerance) << "fp32 output beyond the derived bound";
  EXPECT_LE(worst_bf16, kBlockSumTolerance) << "bf16 output beyond the derived bound";
  EXPECT_LE(mok_error.max, kRowwiseFactor * rowwise_error.max) << "worse than rowwise (max)";
  EXPECT_LE(mok_error.rms(), rowwise_error.rms()) << "worse than rowwise scaling (rms)";

  EXPECT_TRUE(bitwise_equal(dx32, run<float>(p, DgradOutput::kFp32, false)))
      << "fp32: repeated runs differ";
  EXPECT_TRUE(bitwise_equal(dx32, run<float>(p, DgradOutput::kFp32, true)))
      << "fp32: with expert_counts (the same rows) differs";
  for (int num_sms : {1, 3, 7}) {
    EXPECT_TRUE(bitwise_equal(dx16, run<bf16>(p, DgradOutput::kBf16, false, num_sms)))
        << "bf16: a grid of " << num_sms << " CTAs differs from the full grid";
    EXPECT_TRUE(bitwise_equal(dx32, run<float>(p, DgradOutput::kFp32, false, num_sms)))
        << "fp32: a grid of " << num_sms << " CTAs differs from the full grid";
  }
}

}  // namespace
}  // namespace mok::gemm_test
