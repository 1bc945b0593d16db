// FP8 blockwise-scaled grouped forward GEMM (mok/gemm_fp8.hpp) against an fp64 oracle computed
// from the same E4M3 bytes and fp32 scales: experts with 0, 1, 63 ... 300 rows, a padded row
// layout (expert_counts), K = 128 and K = 384 (not a multiple of 512), N not a multiple of 128,
// every output poisoned before each run, repeated runs, other grids and the kernel's pipelines
// (clusters, stages) bitwise equal.
//
// Two kinds of data:
//  - exact: E4M3 integers in [-4, 4] and power-of-two scales. Every block sum P is an integer of
//    at most 128 · 16 = 2^11 and every promoted sum fits fp32's 24 bits, so any accumulation of at
//    least 11 bits is exact: the fp32 output must equal the oracle bit for bit, the bf16 and
//    SwiGLU outputs the oracle rounded once. This pins indexing, tails, scales and promotion.
//  - random: values of several magnitudes quantized by mok::quantize::quantize_cpu. The tensor
//    cores sum E4M3 products with fewer bits than fp32 (an accumulator of ~13 mantissa bits is
//    reported for Hopper), so P carries a rounding error; its bound is derived at
//    kBlockSumTolerance below, and the test prints the measured worst case next to it.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <vector>

#include "gemm_test_support.hpp"
#include "mok/detail/fp8_numerics.hpp"
#include "mok/detail/numerics.hpp"
#include "mok/error.hpp"
#include "mok/gemm_fp8.hpp"
#include "mok/quantize.hpp"

namespace mok::gemm_test {
namespace {

using namespace mok::gemm;

constexpr int kScaleBlock = 128;

// Tolerance of one element against the oracle, relative to S = sum_k |sa a · sb b| (the sum of
// the magnitudes of its dequantized products). Each 128-wide block sum P is formed by 4 wgmma
// k32 steps; with an accumulator of p >= 13 mantissa bits each rounding (or truncation) of a
// running sum of at most S_block in magnitude errs by less than 2^-13 · S_block. Allowing 8 such
// roundings per block (the 4 accumulations plus the adds inside each k32 step's tree) bounds the
// block's error by 2^-10 · S_block; the promotion (an fp32 product of scales and an fma per block)
// adds a few 2^-24 relative, so 2^-10 · S covers the sum over blocks. An indexing or scale error
// would instead be of the size of a whole block's |sa sb P|, i.e. of order S_block / sqrt(128).
constexpr double kBlockSumTolerance = 0x1p-10;

// Rows of each expert; a last row block of at most 64 rows runs as a half tile (1, 63, 64, 129,
// 300 - 256 = 44 and 0), the others (65, 127, 128, 200) as full tiles.
const std::vector<int> kRowsPerExpert = {0, 1, 63, 64, 65, 127, 128, 129, 300, 0, 200};
constexpr int kSpareRows = 37;  // capacity past the last expert: must stay untouched

struct Fp8Problem {
  int num_experts = 0, capacity = 0, n = 0, k = 0;
  std::vector<int> offsets;  // [E + 1]
  std::vector<int> counts;   // [E]: rows of each expert (fewer than its offsets span if padded)
  std::vector<uint8_t> x, w;
  std::vector<float> x_scales, w_scales;
  int k_blocks() const { return k / kScaleBlock; }
  int n_blocks() const { return (n + kScaleBlock - 1) / kScaleBlock; }
};

// Offsets of the experts' rows; padding > 0 rounds each expert's span up to a multiple of it (a
// tile-padded layout, whose extra rows no tile may read into a result).
void lay_out_rows(Fp8Problem& p, int padding) {
  p.num_experts = static_cast<int>(kRowsPerExpert.size());
  p.counts = kRowsPerExpert;
  p.offsets.assign(p.num_experts + 1, 0);
  for (int e = 0; e < p.num_experts; ++e) {
    const int span = padding > 0 ? (p.counts[e] + padding - 1) / padding * padding : p.counts[e];
    p.offsets[e + 1] = p.offsets[e] + span;
  }
  p.capacity = p.offsets.back() + kSpareRows;
}

// E4M3 integers in [-4, 4] (codes of exact values) and scales 2^j, j in [-2, 2].
Fp8Problem exact_problem(int n, int k, int padding, uint32_t seed) {
  Fp8Problem p;
  p.n = n;
  p.k = k;
  lay_out_rows(p, padding);
  std::mt19937 generator(seed);
  std::uniform_int_distribution<int> integer(-4, 4), exponent(-2, 2);
  const auto code = [&] { return fp8::encode_e4m3(static_cast<float>(integer(generator))); };
  const auto scale = [&] { return std::ldexp(1.0f, exponent(generator)); };
  p.x.resize(static_cast<size_t>(p.capacity) * k);
  for (auto& value : p.x) value = code();
  p.w.resize(static_cast<size_t>(p.num_experts) * n * k);
  for (auto& value : p.w) value = code();
  p.x_scales.resize(static_cast<size_t>(p.capacity) * p.k_blocks());
  for (auto& value : p.x_scales) value = scale();
  p.w_scales.resize(static_cast<size_t>(p.num_experts) * p.n_blocks() * p.k_blocks());
  for (auto& value : p.w_scales) value = scale();
  return p;
}

// Random values of magnitudes varying by row, column and block, quantized by mok's quantizers
// (1 x 128 for x, 128 x 128 for w).
Fp8Problem random_problem(int n, int k, uint32_t seed) {
  Fp8Problem p;
  p.n = n;
  p.k = k;
  lay_out_rows(p, 0);
  std::mt19937 generator(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x(static_cast<size_t>(p.capacity) * k),
      w(static_cast<size_t>(p.num_experts) * n * k);
  for (size_t i = 0; i < x.size(); ++i) {
    const size_t row = i / k, column = i % k;
    x[i] = normal(generator) * std::ldexp(1.0f, static_cast<int>((row + column / 128) % 9) - 4);
  }
  for (size_t i = 0; i < w.size(); ++i) {
    const size_t row = i / k, column = i % k;
    w[i] = 0.05f * normal(generator) *
           std::ldexp(1.0f, static_cast<int>((row / 128 + 3 * (column / 128)) % 5) - 2);
  }
  const quantize::Layout x_layout =
      quantize::describe(quantize::Format::kFp8, 1, p.capacity, k, 1, kScaleBlock, false);
  const quantize::Layout w_layout = quantize::describe(quantize::Format::kFp8, p.num_experts, n, k,
                                                       kScaleBlock, kScaleBlock, false);
  p.x.resize(x_layout.num_elements());
  p.x_scales.resize(x_layout.num_scales());
  p.w.resize(w_layout.num_elements());
  p.w_scales.resize(w_layout.num_scales());
  quantize::quantize_cpu(x_layout, x.data(), quantize::InputType::kFp32, p.x.data(),
                         p.x_scales.data());
  quantize::quantize_cpu(w_layout, w.data(), quantize::InputType::kFp32, p.w.data(),
                         p.w_scales.data());
  return p;
}

// fp64 oracle y = sum_kb sa sb sum_k a b over every expert's rows, and S = sum |sa a sb b|.
struct Fp8Oracle {
  std::vector<double> y, magnitude;
  std::vector<bool> written;

  explicit Fp8Oracle(const Fp8Problem& p) {
    const size_t count = static_cast<size_t>(p.capacity) * p.n;
    y.assign(count, 0.0);
    magnitude.assign(count, 0.0);
    written.assign(count, false);
    std::vector<double> x(p.x.size()), w(p.w.size());
    for (size_t i = 0; i < x.size(); ++i) x[i] = fp8::decode_e4m3(p.x[i]);
    for (size_t i = 0; i < w.size(); ++i) w[i] = fp8::decode_e4m3(p.w[i]);
    for (int e = 0; e < p.num_experts; ++e) {
      for (int row = p.offsets[e]; row < p.offsets[e] + p.counts[e]; ++row) {
        for (int column = 0; column < p.n; ++column) {
          const size_t w_row = static_cast<size_t>(e) * p.n + column;
          double sum = 0.0, sum_abs = 0.0;
          for (int kb = 0; kb < p.k_blocks(); ++kb) {
            const double scale =
                static_cast<double>(p.x_scales[static_cast<size_t>(row) * p.k_blocks() + kb]) *
                p.w_scales[(static_cast<size_t>(e) * p.n_blocks() + column / kScaleBlock) *
                               p.k_blocks() +
                           kb];
            double block = 0.0, block_abs = 0.0;
            for (int kk = kb * kScaleBlock; kk < (kb + 1) * kScaleBlock; ++kk) {
              const double product = x[static_cast<size_t>(row) * p.k + kk] * w[w_row * p.k + kk];
              block += product;
              block_abs += std::abs(product);
            }
            sum += scale * block;
            sum_abs += std::abs(scale) * block_abs;
          }
          const size_t index = static_cast<size_t>(row) * p.n + column;
          y[index] = sum;
          magnitude[index] = sum_abs;
          written[index] = true;
        }
      }
    }
  }
};

class GroupedGemmFp8 : public ::testing::Test {
 protected:
  void SetUp() override { MOK_REQUIRE_HOPPER(); }

  void upload(const Fp8Problem& problem) {
    x_ = std::make_unique<DeviceBuffer<uint8_t>>(problem.x);
    w_ = std::make_unique<DeviceBuffer<uint8_t>>(problem.w);
    x_scales_ = std::make_unique<DeviceBuffer<float>>(problem.x_scales);
    w_scales_ = std::make_unique<DeviceBuffer<float>>(problem.w_scales);
    offsets_ = std::make_unique<DeviceBuffer<int>>(problem.offsets);
    counts_ = std::make_unique<DeviceBuffer<int>>(problem.counts);
  }

  // with_counts: pass expert_counts (a padded layout must; an unpadded one may).
  template <class T>
  std::vector<T> run(const Fp8Problem& problem, ForwardOutput output, bool with_counts,
                     int num_sms = 0, const Fp8Pipeline& pipeline = {}) {
    const int width = output == ForwardOutput::kSwiGluBf16 ? problem.n / 2 : problem.n;
    DeviceBuffer<T> y(static_cast<size_t>(problem.capacity) * width);
    y.poison();
    GroupedShape shape{problem.num_experts, problem.capacity, problem.n, problem.k};
    if (with_counts) shape.expert_counts = counts_->get();
    grouped_forward_fp8(shape, x_->get(), x_scales_->get(), w_->get(), w_scales_->get(),
                        offsets_->get(), y.get(), output, nullptr, LaunchOptions{num_sms},
                        pipeline);
    MOK_CUDA_CHECK(cudaDeviceSynchronize());
    return y.download();
  }

  // Exact data: fp32 bitwise the oracle, bf16 the oracle rounded once, SwiGLU the fused
  // composition of those; untouched elements still poisoned.
  void expect_exact(const Fp8Problem& problem, bool with_counts, const std::string& what) {
    upload(problem);
    const Fp8Oracle oracle(problem);
    const auto y32 = run<float>(problem, ForwardOutput::kFp32, with_counts);
    const auto y16 = run<bf16>(problem, ForwardOutput::kBf16, with_counts);
    size_t fp32_mismatches = 0, bf16_mismatches = 0, poison_errors = 0;
    for (size_t i = 0; i < y32.size(); ++i) {
      if (!oracle.written[i]) {
        poison_errors += (is_poison(y32[i]) ? 0 : 1) + (is_poison(y16[i]) ? 0 : 1);
        continue;
      }
      const float expected = static_cast<float>(oracle.y[i]);
      ASSERT_EQ(static_cast<double>(expected), oracle.y[i]) << "exact data is not exact in fp32";
      fp32_mismatches += fp8::float_to_bits(y32[i]) == fp8::float_to_bits(expected) ? 0 : 1;
      bf16_mismatches += y16[i].bits == bf16(expected).bits ? 0 : 1;
    }
    EXPECT_EQ(fp32_mismatches, 0u) << what << ": fp32 outputs differing from the exact oracle";
    EXPECT_EQ(bf16_mismatches, 0u) << what << ": bf16 outputs differing from bf16(oracle)";
    EXPECT_EQ(poison_errors, 0u) << what << ": elements written outside the experts' rows";
    if (problem.n % 16 == 0) {
      const auto h = run<bf16>(problem, ForwardOutput::kSwiGluBf16, with_counts);
      expect_swiglu_composition(problem, oracle, y32, h, what);
    }
  }

  // h = bf16(swiglu(gate, up)) of the fp32 GEMM's fused columns, bit for bit.
  static void expect_swiglu_composition(const Fp8Problem& problem, const Fp8Oracle& oracle,
                                        const std::vector<float>& y32, const std::vector<bf16>& h,
                                        const std::string& what) {
    const int width = problem.n / 2;
    size_t mismatches = 0, poison_errors = 0;
    for (int row = 0; row < problem.capacity; ++row) {
      for (int i = 0; i < width; ++i) {
        const size_t index = static_cast<size_t>(row) * width + i;
        const size_t gate = static_cast<size_t>(row) * problem.n + (i / 8) * 16 + i % 8;
        if (!oracle.written[gate]) {
          poison_errors += is_poison(h[index]) ? 0 : 1;
          continue;
        }
        mismatches +=
            h[index].bits == bf16(numerics::swiglu(y32[gate], y32[gate + 8])).bits ? 0 : 1;
      }
    }
    EXPECT_EQ(mismatches, 0u) << what << ": SwiGLU epilogue differs from fp32 GEMM + swiglu";
    EXPECT_EQ(poison_errors, 0u) << what << ": SwiGLU elements written outside the rows";
  }

  // Every pipeline (clusters of 1 or 2, 3 or 4 stages) on grids of 1, 2, 3, 7 CTAs and the whole
  // GPU bitwise equal to single CTAs with 3 stages on the whole GPU.
  template <class T>
  void expect_pipelines_equal(const Fp8Problem& problem, ForwardOutput output, bool with_counts,
                              const std::string& what) {
    const auto reference = run<T>(problem, output, with_counts, 0, Fp8Pipeline{1, 3});
    for (int cluster : {1, 2}) {
      for (int stages : {3, 4}) {
        for (int num_sms : {0, 1, 2, 3, 7}) {
          EXPECT_TRUE(bitwise_equal(
              reference, run<T>(problem, output, with_counts, num_sms, {cluster, stages})))
              << what << ": clusters of " << cluster << ", " << stages << " stages, a grid of "
              << num_sms << " CTAs (0: the GPU) differ from single CTAs with 3 stages";
        }
      }
    }
  }

  std::unique_ptr<DeviceBuffer<uint8_t>> x_, w_;
  std::unique_ptr<DeviceBuffer<float>> x_scales_, w_scales_;
  std::unique_ptr<DeviceBuffer<int>> offsets_, counts_;
};

// N = 272: a full 256-column tile and a 16-column one (its second 128-column piece past N);
// K = 384: three k-blocks.
TEST_F(GroupedGemmFp8, ExactDataBitwiseOracle) {
  expect_exact(exact_problem(272, 384, 0, 1), false, "exact 272 x 384");
}

// K = 128: one k-block per tile (the promotion of a single block); N = 136.
TEST_F(GroupedGemmFp8, ExactDataSingleKBlock) {
  expect_exact(exact_problem(136, 128, 0, 2), false, "exact 136 x 128");
}

// A tile-padded layout: each expert's span rounded up to 128 rows, counts on the device; the
// padding rows are neither read into a result nor written.
TEST_F(GroupedGemmFp8, ExactDataPaddedRows) {
  expect_exact(exact_problem(272, 640, 128, 3), true, "exact padded 272 x 640");
}

// Quantized random data: within the derived bound of the fp64 oracle; repeated runs and grids
// of 1, 3 and 7 CTAs bitwise equal; SwiGLU the fused composition of the fp32 result.
TEST_F(GroupedGemmFp8, RandomDataWithinBoundAndBitwiseRepeatable) {
  const Fp8Problem problem = random_problem(272, 1920, 4);
  upload(problem);
  const Fp8Oracle oracle(problem);
  const auto y32 = run<float>(problem, ForwardOutput::kFp32, false);
  const auto y16 = run<bf16>(problem, ForwardOutput::kBf16, false);
  double worst_fp32 = 0.0, worst_bf16 = 0.0, sum_squares = 0.0;
  size_t num_written = 0, poison_errors = 0, nonfinite = 0;
  for (size_t i = 0; i < y32.size(); ++i) {
    if (!oracle.written[i]) {
      poison_errors += (is_poison(y32[i]) ? 0 : 1) + (is_poison(y16[i]) ? 0 : 1);
      continue;
    }
    if (!std::isfinite(y32[i]) || !std::isfinite(y16[i].to_float())) ++nonfinite;
    const double s = std::max(oracle.magnitude[i], 1e-300);
    const double fp32_error = std::abs(static_cast<double>(y32[i]) - oracle.y[i]) / s;
    // bf16: the fp32 result's error plus one rounding to 8 significant bits (at most 2^-8
    // relative, of the fp32 value: 2^-8 |y| plus a rounding of the error itself, covered by
    // taking 2^-8 of the larger of |oracle| and |y|).
    const double bf16_value = y16[i].to_float();
    const double bf16_error =
        std::max(0.0, std::abs(bf16_value - oracle.y[i]) -
                          0x1p-8 * std::max(std::abs(oracle.y[i]), std::abs(bf16_value))) /
        s;
    worst_fp32 = std::max(worst_fp32, fp32_error);
    worst_bf16 = std::max(worst_bf16, bf16_error);
    sum_squares += fp32_error * fp32_error;
    ++num_written;
  }
  std::cout << "[ accuracy ] fp8 forward, K = 1920: max |y - fp64| / S = " << worst_fp32 << " (2^"
            << std::log2(std::max(worst_fp32, 1e-300)) << "), rms "
            << std::sqrt(sum_squares / std::max<size_t>(num_written, 1)) << "; bf16 beyond its "
            << "rounding " << worst_bf16 << "; bound " << kBlockSumTolerance << "\n";
  EXPECT_EQ(poison_errors, 0u) << "elements written outside the experts' rows";
  EXPECT_EQ(nonfinite, 0u) << "non-finite results";
  EXPECT_LE(worst_fp32, kBlockSumTolerance) << "fp32 output beyond the derived bound";
  EXPECT_LE(worst_bf16, kBlockSumTolerance) << "bf16 output beyond the derived bound";

  EXPECT_TRUE(bitwise_equal(y32, run<float>(problem, ForwardOutput::kFp32, false)))
      << "fp32: repeated runs differ";
  EXPECT_TRUE(bitwise_equal(y32, run<float>(problem, ForwardOutput::kFp32, true)))
      << "fp32: with expert_counts (the same rows) differs";
  for (int num_sms : {1, 3, 7}) {
    EXPECT_TRUE(bitwise_equal(y16, run<bf16>(problem, ForwardOutput::kBf16, false, num_sms)))
        << "bf16: a grid of " << num_sms << " CTAs differs from the full grid";
    EXPECT_TRUE(bitwise_equal(y32, run<float>(problem, ForwardOutput::kFp32, false, num_sms)))
        << "fp32: a grid of " << num_sms << " CTAs differs from the full grid";
  }
  const auto h = run<bf16>(problem, ForwardOutput::kSwiGluBf16, false);
  expect_swiglu_composition(problem, oracle, y32, h, "random");
  EXPECT_TRUE(bitwise_equal(h, run<bf16>(problem, ForwardOutput::kSwiGluBf16, false, 3)))
      << "SwiGLU: a grid of 3 CTAs differs from the full grid";
}

// Clusters sharing the weight tile and the ring's depth change no bit: on the padded exact layout
// (experts of 1 and 3 row blocks leave a cluster's second M block empty) and on quantized random
// data, for every output.
TEST_F(GroupedGemmFp8, PipelinesBitwiseEqual) {
  const Fp8Problem padded = exact_problem(272, 640, 128, 3);
  upload(padded);
  expect_pipelines_equal<bf16>(padded, ForwardOutput::kBf16, true, "exact padded, bf16");
  expect_pipelines_equal<float>(padded, ForwardOutput::kFp32, true, "exact padded, fp32");
  expect_pipelines_equal<bf16>(padded, ForwardOutput::kSwiGluBf16, true, "exact padded, SwiGLU");
  const Fp8Problem random = random_problem(272, 1920, 4);
  upload(random);
  expect_pipelines_equal<bf16>(random, ForwardOutput::kBf16, false, "random, bf16");
  expect_pipelines_equal<float>(random, ForwardOutput::kFp32, false, "random, fp32");
  expect_pipelines_equal<bf16>(random, ForwardOutput::kSwiGluBf16, false, "random, SwiGLU");
}

// grouped_swiglu_fp8's gate/up sums (a training forward's saved context): the bytes of
// grouped_forward_fp8's bf16 output on the same operands (poisoned rows outside the experts'
// included: nothing written there), and h and its scales unchanged by asking for them; on the full
// grid and on 3 CTAs, whose tiles fall elsewhere.
TEST_F(GroupedGemmFp8, SwiGluGateUpSumsAreTheBf16Forward) {
  const Fp8Problem problem = random_problem(512, 640, 5);
  upload(problem);
  const std::vector<bf16> expected = run<bf16>(problem, ForwardOutput::kBf16, false);
  const GroupedShape shape{problem.num_experts, problem.capacity, problem.n, problem.k};
  const size_t rows = static_cast<size_t>(problem.capacity), inter = problem.n / 2;
  for (const int num_sms : {0, 3}) {
    DeviceBuffer<uint8_t> h(rows * inter), h_alone(rows * inter);
    DeviceBuffer<float> h_scales(rows * inter / kScaleBlock),
        h_scales_alone(rows * inter / kScaleBlock);
    DeviceBuffer<bf16> gate_up(rows * problem.n);
    for (auto* buffer : {&h, &h_alone}) buffer->poison();
    for (auto* buffer : {&h_scales, &h_scales_alone}) buffer->poison();
    gate_up.poison();
    grouped_swiglu_fp8(shape, x_->get(), x_scales_->get(), w_->get(), w_scales_->get(),
                       offsets_->get(), h_alone.get(), h_scales_alone.get(), nullptr,
                       LaunchOptions{num_sms});
    grouped_swiglu_fp8(shape, x_->get(), x_scales_->get(), w_->get(), w_scales_->get(),
                       offsets_->get(), h.get(), h_scales.get(), nullptr, LaunchOptions{num_sms},
                       {}, gate_up.get());
    MOK_CUDA_CHECK(cudaDeviceSynchronize());
    const std::string grid = num_sms == 0 ? "full grid" : "3 CTAs";
    EXPECT_TRUE(bitwise_equal(gate_up.download(), expected))
        << grid << ": the gate/up sums differ from grouped_forward_fp8's bf16 output";
    EXPECT_TRUE(bitwise_equal(h.download(), h_alone.download())) << grid << ": h changed";
    EXPECT_TRUE(bitwise_equal(h_scales.download(), h_scales_alone.download()))
        << grid << ": h's scales changed";
  }
  // With a row map (a layer's row_source): GEMM row r to row (rows - 1 - r), every third row to
  // none; each mapped row holds its GEMM row's sums, every other row stays poisoned.
  std::vector<int32_t> map(rows);
  for (size_t r = 0; r < rows; ++r) map[r] = r % 3 == 2 ? -1 : static_cast<int32_t>(rows - 1 - r);
  DeviceBuffer<int32_t> map_device(map);
  DeviceBuffer<uint8_t> h(rows * inter);
  DeviceBuffer<float> h_scales(rows * inter / kScaleBlock);
  DeviceBuffer<bf16> mapped(rows * problem.n);
  mapped.poison();
  grouped_swiglu_fp8(shape, x_->get(), x_scales_->get(), w_->get(), w_scales_->get(),
                     offsets_->get(), h.get(), h_scales.get(), nullptr, {}, {}, mapped.get(),
                     map_device.get());
  MOK_CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<bf16> got = mapped.download();
  std::vector<bf16> want(got.size());
  std::memset(want.data(), 0xff, want.size() * sizeof(bf16));  // DeviceBuffer::poison's bytes
  for (size_t r = 0; r < rows; ++r) {
    if (map[r] < 0 || is_poison(expected[r * problem.n])) continue;  // unmapped, or no expert's row
    std::copy_n(expected.begin() + r * problem.n, problem.n, want.begin() + map[r] * problem.n);
  }
  EXPECT_TRUE(bitwise_equal(got, want)) << "the row map: rows differ from the mapped bf16 sums";
}

// Host stand-ins for the argument checks, which run before anything is launched (no GPU needed).
alignas(16) uint8_t bytes[64];
alignas(16) float scales[16];
alignas(16) float output[16];
const int offsets[2] = {0, 1};

TEST(GroupedGemmFp8Arguments, RejectsBadShapesAndPointers) {
  const auto call = [](GroupedShape shape, ForwardOutput out = ForwardOutput::kBf16,
                       const uint8_t* x = bytes, const float* x_scales = scales,
                       LaunchOptions options = {}, Fp8Pipeline pipeline = {}) {
    grouped_forward_fp8(shape, x, x_scales, bytes, scales, offsets, output, out, nullptr, options,
                        pipeline);
  };
  EXPECT_THROW(call({1, 1, 128, 100}), Error);  // k not a multiple of 128
  EXPECT_THROW(call({1, 1, 128, 0}), Error);
  EXPECT_THROW(call({1, 1, 12, 128}), Error);                               // n not a multiple of 8
  EXPECT_THROW(call({1, 1, 136, 128}, ForwardOutput::kSwiGluBf16), Error);  // n % 16 != 0
  EXPECT_THROW(call({1, 0, 128, 128}), Error);                              // no capacity
  EXPECT_THROW(call({1, 1, 128, 128}, ForwardOutput::kBf16, bytes + 1), Error);  // misaligned x
  EXPECT_THROW(call({1, 1, 128, 128}, ForwardOutput::kBf16, bytes, nullptr), Error);
  EXPECT_THROW(call({1, 1, 128, 128}, ForwardOutput::kBf16, bytes, scales,
                    LaunchOptions{0, GemmEngine::kPingpong}),
               Error);
  EXPECT_THROW(call({1, 1, 128, 128}, ForwardOutput::kBf16, bytes, scales, LaunchOptions{-1}),
               Error);
  EXPECT_THROW(call({1, 1, 128, 128}, ForwardOutput::kBf16, bytes, scales, {}, {3, 0}), Error);
  EXPECT_THROW(call({1, 1, 128, 128}, ForwardOutput::kBf16, bytes, scales, {}, {0, 2}), Error);
  try {
    call({1, 1, 128, 100});
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("shape.k"), std::string::npos) << error.what();
  }
  // grouped_swiglu_fp8's gate/up sums, when asked for, 16-byte aligned like its other outputs.
  alignas(16) bf16 sums[16];
  EXPECT_THROW(grouped_swiglu_fp8({1, 1, 256, 128}, bytes, scales, bytes, scales, offsets, bytes,
                                  scales, nullptr, {}, {}, sums + 1),
               Error);
}

}  // namespace
}  // namespace mok::gemm_test
