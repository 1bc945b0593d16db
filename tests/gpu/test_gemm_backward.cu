// dgrad dx_e = dy_e · W_e and wgrad dW_e = dy_eᵀ · x_e against host references, with experts of
// 0, 1, 127, 128, 129 and thousands of rows (the wgrad K-loop runs over them, tails included);
// wgrad fresh fp32 / bf16 and accumulated into an fp32 main_grad; wgrad bitwise equal whatever
// the number of SMs; dgrad bitwise equal on both engines, plain and scattered; a call over a
// range of the experts computes those alone.
#include <algorithm>
#include <numeric>
#include <random>
#include <tuple>
#include <utility>
#include <vector>

#include "gemm_test_support.hpp"
#include "mok/detail/numerics.hpp"
#include "mok/error.hpp"
#include "mok/gemm.hpp"

namespace mok::gemm_test {
namespace {

using namespace mok::gemm;

constexpr int kOut = 320;  // n: rows of W_e (dgrad's reduction, wgrad's M: 2.5 M tiles)
constexpr int kIn = 328;   // k: columns of W_e (dgrad's N, wgrad's N: 1.3 N tiles)
// dgrad (128-row blocks): a group's last row block of at most 64 rows is a half tile
// (is_half_tile): tails of 1 (1, 129, 257), 15, 16 (143, 144), 17-33 (273, 287, 288, 148, 160, 161,
// 32, 672, 33), 40, 52 and 64 rows (424, 2100, 64, 192, 576). 65, 80, 104, 112, 127 and 193 end in
// a full tile; 128 and 256 are whole blocks.
// wgrad (64-row k-blocks): a group's last k-block runs ceil(rows / 16) k16 steps, 1 to 4, each
// count also on a whole number of 16 rows: 1 (1, 65, 80, 144), 2 (148, 273, 287, 32, 160, 288),
// 3 (33, 104, 161, 424, 112), 4 (127, 2100, 64, 128).
const std::vector<int> kRowsPerExpert = {
    0,   1,   127, 128, 129, 2100, 0,   64, 65,  192, 193,  // half and full tiles, a long one
    143, 144, 257, 273, 148, 160,  161, 32, 672, 0,   256,  // dgrad's tails
    424, 576, 33,  80,  104, 112,  288, 287};               // wgrad's last k-blocks
constexpr int kSpareRows = 29;
// fp32 results over K up to 2,100 rows: the tensor cores' fp32 accumulation does not round to
// nearest at every add, so its error grows faster with K than a sequential host fp32 sum's
// (first device run: 5.7x the host's L2 error at K = 2,100; 2x or less for bf16 results,
// where the output rounding dominates).
constexpr double kFp32Factor = 8.0;

struct BackwardProblem {
  int num_experts = static_cast<int>(kRowsPerExpert.size());
  std::vector<int> offsets = offsets_of(kRowsPerExpert);
  int total_rows = offsets.back();
  int capacity = total_rows + kSpareRows;
  std::vector<bf16> dy = random_bf16(static_cast<size_t>(capacity) * kOut, 21);
  std::vector<bf16> x = random_bf16(static_cast<size_t>(capacity) * kIn, 22);
  std::vector<bf16> w = random_bf16(static_cast<size_t>(num_experts) * kOut * kIn, 23);

  GroupedShape shape() const { return {num_experts, capacity, kOut, kIn}; }
  std::vector<float> floats(const std::vector<bf16>& values) const {
    std::vector<float> result(values.size());
    for (size_t i = 0; i < values.size(); ++i) result[i] = values[i].to_float();
    return result;
  }
};

class GroupedGemmBackward : public ::testing::Test {
 protected:
  void SetUp() override {
    MOK_REQUIRE_HOPPER();
    p_ = std::make_unique<BackwardProblem>();
    dy_ = std::make_unique<DeviceBuffer<bf16>>(p_->dy.size());
    x_ = std::make_unique<DeviceBuffer<bf16>>(p_->x.size());
    w_ = std::make_unique<DeviceBuffer<bf16>>(p_->w.size());
    offsets_ = std::make_unique<DeviceBuffer<int>>(p_->offsets.size());
    dy_->upload(p_->dy);
    x_->upload(p_->x);
    w_->upload(p_->w);
    offsets_->upload(p_->offsets);
  }

  // bf16 dx [num_output_rows, k], poisoned first: capacity rows, or more with shape.output_rows.
  std::vector<bf16> run_dgrad(const GroupedShape& shape, int num_output_rows,
                              const LaunchOptions& options) {
    DeviceBuffer<bf16> dx(static_cast<size_t>(num_output_rows) * kIn);
    dx.poison();
    grouped_dgrad(shape, dy_->get(), w_->get(), offsets_->get(), dx.get(), nullptr, options);
    MOK_CUDA_CHECK(cudaDeviceSynchronize());
    return dx.download();
  }
  std::vector<bf16> run_dgrad(int num_sms = 0, GemmEngine engine = GemmEngine::kAuto) {
    return run_dgrad(p_->shape(), p_->capacity, LaunchOptions{num_sms, engine});
  }

  // `initial` (fp32 main_grad) is uploaded for kAccumulateFp32; the output is poisoned otherwise.
  template <class T>
  std::vector<T> run_wgrad(WgradOutput output, int num_sms, const std::vector<float>* initial,
                           GemmEngine engine = GemmEngine::kAuto, int cluster = 0) {
    DeviceBuffer<T> dw(static_cast<size_t>(p_->num_experts) * kOut * kIn);
    if constexpr (std::is_same_v<T, float>) {
      if (initial != nullptr)
        dw.upload(*initial);
      else
        dw.poison();
    } else {
      dw.poison();
    }
    grouped_wgrad(p_->shape(), dy_->get(), x_->get(), offsets_->get(), dw.get(), output, nullptr,
                  LaunchOptions{num_sms, engine, cluster});
    MOK_CUDA_CHECK(cudaDeviceSynchronize());
    return dw.download();
  }

  // wgrad on `shape` (e.g. a range of the experts), its output poisoned first.
  template <class T>
  std::vector<T> run_wgrad(const GroupedShape& shape, WgradOutput output,
                           const LaunchOptions& options) {
    DeviceBuffer<T> dw(static_cast<size_t>(p_->num_experts) * kOut * kIn);
    dw.poison();
    grouped_wgrad(shape, dy_->get(), x_->get(), offsets_->get(), dw.get(), output, nullptr,
                  options);
    MOK_CUDA_CHECK(cudaDeviceSynchronize());
    return dw.download();
  }

  std::unique_ptr<BackwardProblem> p_;
  std::unique_ptr<DeviceBuffer<bf16>> dy_, x_, w_;
  std::unique_ptr<DeviceBuffer<int>> offsets_;
};

// dx's fp64 oracle and bf16-rounded fp32 host sum in k order, [capacity, k]; `written` marks the
// experts' rows.
struct DgradReference {
  std::vector<double> oracle;
  std::vector<float> same_precision;
  std::vector<bool> written;

  explicit DgradReference(const BackwardProblem& p) {
    const auto dy = p.floats(p.dy), w = p.floats(p.w);
    const size_t count = static_cast<size_t>(p.capacity) * kIn;
    oracle.assign(count, 0.0);
    same_precision.assign(count, 0.0f);
    written.assign(count, false);
    for (int e = 0; e < p.num_experts; ++e) {
      for (int row = p.offsets[e]; row < p.offsets[e + 1]; ++row) {
        for (int column = 0; column < kIn; ++column) {
          double sum64 = 0.0;
          float sum32 = 0.0f;
          for (int j = 0; j < kOut; ++j) {
            const float a = dy[static_cast<size_t>(row) * kOut + j];
            const float b = w[(static_cast<size_t>(e) * kOut + j) * kIn + column];
            sum64 += static_cast<double>(a) * b;
            sum32 = numerics::add_rn(sum32, numerics::mul_rn(a, b));
          }
          const size_t index = static_cast<size_t>(row) * kIn + column;
          oracle[index] = sum64;
          same_precision[index] = round_to_bf16(sum32);
          written[index] = true;
        }
      }
    }
  }

  // The same values with row r at row destination[r] of num_output_rows (a scatter by
  // output_rows); rows no row lands on are not written.
  DgradReference scattered(const std::vector<int>& destination, int num_output_rows) const {
    DgradReference result;
    const size_t count = static_cast<size_t>(num_output_rows) * kIn;
    result.oracle.assign(count, 0.0);
    result.same_precision.assign(count, 0.0f);
    result.written.assign(count, false);
    for (size_t row = 0; row < destination.size(); ++row) {
      const size_t from = row * kIn, to = static_cast<size_t>(destination[row]) * kIn;
      std::copy_n(oracle.begin() + from, kIn, result.oracle.begin() + to);
      std::copy_n(same_precision.begin() + from, kIn, result.same_precision.begin() + to);
      std::copy_n(written.begin() + from, kIn, result.written.begin() + to);
    }
    return result;
  }

 private:
  DgradReference() = default;
};

// Distinct destinations among num_output_rows rows for `rows` rows, in random order.
std::vector<int> scatter_destinations(int rows, int num_output_rows, uint32_t seed) {
  std::vector<int> destination(static_cast<size_t>(num_output_rows));
  std::iota(destination.begin(), destination.end(), 0);
  std::mt19937 generator(seed);
  std::shuffle(destination.begin(), destination.end(), generator);
  destination.resize(static_cast<size_t>(rows));
  return destination;
}

TEST_F(GroupedGemmBackward, DgradMatchesReference) {
  const DgradReference reference(*p_);
  const auto dx = run_dgrad();
  expect_accuracy(dx, reference.same_precision, reference.oracle, reference.written, 2.0,
                  "dgrad bf16");
  EXPECT_TRUE(bitwise_equal(dx, run_dgrad())) << "dgrad: repeated runs differ";
}

// fp64 oracle and fp32 host sum over each expert's rows in row order, starting from `initial`.
struct WgradReference {
  std::vector<double> oracle;
  std::vector<float> same_precision;
  WgradReference(const BackwardProblem& p, const std::vector<float>& initial) {
    const auto dy = p.floats(p.dy), x = p.floats(p.x);
    oracle.assign(initial.begin(), initial.end());
    same_precision = initial;
    for (int e = 0; e < p.num_experts; ++e) {
      for (int i = 0; i < kOut; ++i) {
        for (int j = 0; j < kIn; ++j) {
          const size_t index = (static_cast<size_t>(e) * kOut + i) * kIn + j;
          double sum64 = oracle[index];
          float sum32 = same_precision[index];
          for (int row = p.offsets[e]; row < p.offsets[e + 1]; ++row) {
            const float a = dy[static_cast<size_t>(row) * kOut + i];
            const float b = x[static_cast<size_t>(row) * kIn + j];
            sum64 += static_cast<double>(a) * b;
            sum32 = numerics::add_rn(sum32, numerics::mul_rn(a, b));
          }
          oracle[index] = sum64;
          same_precision[index] = sum32;
        }
      }
    }
  }
};

TEST_F(GroupedGemmBackward, WgradFreshMatchesReferenceAndIsSmCountInvariant) {
  const size_t count = static_cast<size_t>(p_->num_experts) * kOut * kIn;
  const WgradReference reference(*p_, std::vector<float>(count, 0.0f));
  const std::vector<bool> written(count, true);
  const auto dw = run_wgrad<float>(WgradOutput::kFp32, 0, nullptr);
  expect_accuracy(dw, reference.same_precision, reference.oracle, written, kFp32Factor,
                  "wgrad fp32");
  for (int num_sms : {1, 7, 33}) {
    EXPECT_TRUE(bitwise_equal(dw, run_wgrad<float>(WgradOutput::kFp32, num_sms, nullptr)))
        << "wgrad fp32: grid of " << num_sms << " CTAs differs from the full grid";
  }
  EXPECT_TRUE(bitwise_equal(dw, run_wgrad<float>(WgradOutput::kFp32, 0, nullptr)))
      << "wgrad fp32: repeated runs differ";

  std::vector<float> host_bf16(count);
  for (size_t i = 0; i < count; ++i) host_bf16[i] = round_to_bf16(reference.same_precision[i]);
  const auto dw_bf16 = run_wgrad<bf16>(WgradOutput::kBf16, 0, nullptr);
  expect_accuracy(dw_bf16, host_bf16, reference.oracle, written, 2.0, "wgrad bf16");
  // The bf16 result is the fp32 one rounded once.
  size_t mismatches = 0;
  for (size_t i = 0; i < count; ++i) mismatches += bf16(dw[i]).bits == dw_bf16[i].bits ? 0 : 1;
  EXPECT_EQ(mismatches, 0u) << "wgrad bf16 is not the rounded fp32 result";
}

TEST_F(GroupedGemmBackward, WgradAccumulatesIntoMainGrad) {
  const size_t count = static_cast<size_t>(p_->num_experts) * kOut * kIn;
  std::vector<float> main_grad(count);
  const auto seed_values = random_bf16(count, 24, 4.0f);
  for (size_t i = 0; i < count; ++i) main_grad[i] = seed_values[i].to_float() * 1.25f;
  const WgradReference reference(*p_, main_grad);
  const std::vector<bool> written(count, true);
  const auto dw = run_wgrad<float>(WgradOutput::kAccumulateFp32, 0, &main_grad);
  expect_accuracy(dw, reference.same_precision, reference.oracle, written, kFp32Factor,
                  "wgrad accumulate");
  // Experts without rows leave their main_grad untouched, bit for bit.
  for (int e = 0; e < p_->num_experts; ++e) {
    if (kRowsPerExpert[e] != 0) continue;
    const size_t begin = static_cast<size_t>(e) * kOut * kIn;
    EXPECT_EQ(0, std::memcmp(&dw[begin], &main_grad[begin], sizeof(float) * kOut * kIn))
        << "expert " << e << " has no rows but its main_grad changed";
  }
  EXPECT_TRUE(bitwise_equal(dw, run_wgrad<float>(WgradOutput::kAccumulateFp32, 5, &main_grad)))
      << "wgrad accumulate: 5-CTA grid differs from the full grid";
}

// Both engines sum every element over the same k-blocks in the same order: bitwise equal dgrad
// and wgrad results (fresh fp32, bf16, accumulated), the ping-pong one on several grid sizes.
TEST_F(GroupedGemmBackward, PingpongEqualsCooperativeBitwise) {
  constexpr GemmEngine kPingpong = GemmEngine::kPingpong;
  const auto dx = run_dgrad(0, GemmEngine::kCooperative);
  for (int num_sms : {0, 1, 3}) {
    EXPECT_TRUE(bitwise_equal(dx, run_dgrad(num_sms, kPingpong)))
        << "dgrad: ping-pong on " << num_sms << " CTAs differs from cooperative";
  }
  const size_t count = static_cast<size_t>(p_->num_experts) * kOut * kIn;
  std::vector<float> main_grad(count);
  const auto seed_values = random_bf16(count, 25, 4.0f);
  for (size_t i = 0; i < count; ++i) main_grad[i] = seed_values[i].to_float();
  const auto fp32 = run_wgrad<float>(WgradOutput::kFp32, 0, nullptr, GemmEngine::kCooperative);
  const auto bf16_result =
      run_wgrad<bf16>(WgradOutput::kBf16, 0, nullptr, GemmEngine::kCooperative);
  const auto accumulated =
      run_wgrad<float>(WgradOutput::kAccumulateFp32, 0, &main_grad, GemmEngine::kCooperative);
  for (int num_sms : {0, 1, 7, 33}) {
    EXPECT_TRUE(
        bitwise_equal(fp32, run_wgrad<float>(WgradOutput::kFp32, num_sms, nullptr, kPingpong)))
        << "wgrad fp32: ping-pong on " << num_sms << " CTAs differs from cooperative";
    EXPECT_TRUE(bitwise_equal(bf16_result,
                              run_wgrad<bf16>(WgradOutput::kBf16, num_sms, nullptr, kPingpong)))
        << "wgrad bf16: ping-pong on " << num_sms << " CTAs differs from cooperative";
    EXPECT_TRUE(bitwise_equal(accumulated, run_wgrad<float>(WgradOutput::kAccumulateFp32, num_sms,
                                                            &main_grad, kPingpong)))
        << "wgrad accumulate: ping-pong on " << num_sms << " CTAs differs from cooperative";
  }
}

// dgrad's bf16 rows scattered by output_rows (a permutation of the rows plus spare rows, as the
// layer's schedule sends each expert row to its token's slot): each row lands bitwise where the
// plain result's row lies, on both engines and any grid; rows past the experts' ends and the
// spare output rows stay poisoned; fp32 results and wgrad refuse a scatter.
TEST_F(GroupedGemmBackward, DgradScattersRowsByOutputRows) {
  const auto plain = run_dgrad(0, GemmEngine::kCooperative);
  const int rows = p_->capacity, out_rows = rows + 17;  // 17 output rows get no row
  const std::vector<int> destination = scatter_destinations(rows, out_rows, 31);
  DeviceBuffer<int> map(destination.size());
  map.upload(destination);
  GroupedShape shape = p_->shape();
  shape.output_rows = map.get();
  for (const auto& [engine, num_sms] :
       {std::pair{GemmEngine::kCooperative, 0}, std::pair{GemmEngine::kCooperative, 3},
        std::pair{GemmEngine::kPingpong, 0}, std::pair{GemmEngine::kPingpong, 5}}) {
    SCOPED_TRACE(::testing::Message()
                 << "engine " << static_cast<int>(engine) << ", " << num_sms << " CTAs");
    const std::vector<bf16> scattered = run_dgrad(shape, out_rows, LaunchOptions{num_sms, engine});
    std::vector<bool> target(static_cast<size_t>(out_rows), false);
    int64_t wrong = 0;
    for (int row = 0; row < rows; ++row) {
      const bool real = row < p_->total_rows;  // rows past the experts' ends are never written
      target[destination[row]] = real;
      for (int column = 0; column < kIn; ++column) {
        const bf16 got = scattered[static_cast<size_t>(destination[row]) * kIn + column];
        if (real) {
          wrong += got.bits != plain[static_cast<size_t>(row) * kIn + column].bits ? 1 : 0;
        } else {
          wrong += is_poison(got) ? 0 : 1;
        }
      }
    }
    for (int row = 0; row < out_rows; ++row) {
      if (target[row]) continue;
      for (int column = 0; column < kIn; ++column) {
        wrong += is_poison(scattered[static_cast<size_t>(row) * kIn + column]) ? 0 : 1;
      }
    }
    EXPECT_EQ(wrong, 0) << "elements not where the plain dgrad's rows point";
  }
  DeviceBuffer<float> fp32(static_cast<size_t>(out_rows) * kIn);
  EXPECT_THROW(grouped_dgrad(shape, dy_->get(), w_->get(), offsets_->get(), fp32.get(),
                             DgradOutput::kFp32, nullptr),
               Error);
  EXPECT_THROW(grouped_wgrad(shape, dy_->get(), x_->get(), offsets_->get(), fp32.get(),
                             WgradOutput::kFp32, nullptr),
               Error);
}

// The cooperative bf16 dgrad (whose rounds of tiles rotate over the CTAs, tile_scheduler.cuh)
// and the ping-pong engine sum every element over the same k16 steps in the same order: bitwise
// equal, plain and scattered by output_rows, on several grids, with experts whose last row blocks
// are half tiles of every size class (kRowsPerExpert), and within the reference's bound (N = 328:
// the last column block holds 72 columns).
TEST_F(GroupedGemmBackward, DgradEnginesEqualBitwisePlainAndScattered) {
  const DgradReference plain_reference(*p_);
  const int rows = p_->capacity, out_rows = rows + 17;
  const std::vector<int> destination = scatter_destinations(rows, out_rows, 32);
  DeviceBuffer<int> map(destination.size());
  map.upload(destination);
  GroupedShape scatter_shape = p_->shape();
  scatter_shape.output_rows = map.get();
  const DgradReference scatter_reference = plain_reference.scattered(destination, out_rows);
  for (const bool scatter : {false, true}) {
    const GroupedShape shape = scatter ? scatter_shape : p_->shape();
    const int num_output_rows = scatter ? out_rows : rows;
    const DgradReference& reference = scatter ? scatter_reference : plain_reference;
    // (rounds rotating by 1 CTA on 132 SMs, 4 on 1 and 7 CTAs, 3 on 2 and 200; 200 CTAs are more
    // than the 144 tiles)
    for (int num_sms : {0, 1, 2, 7, 200}) {
      SCOPED_TRACE(::testing::Message()
                   << (scatter ? "output_rows" : "no output_rows") << ", " << num_sms << " CTAs");
      const auto dx =
          run_dgrad(shape, num_output_rows, LaunchOptions{num_sms, GemmEngine::kCooperative});
      expect_accuracy(dx, reference.same_precision, reference.oracle, reference.written, 2.0,
                      "dgrad bf16, cooperative");
      EXPECT_TRUE(bitwise_equal(
          dx, run_dgrad(shape, num_output_rows, LaunchOptions{num_sms, GemmEngine::kPingpong})))
          << "dgrad: the cooperative engine differs from the ping-pong engine";
    }
  }
}

// wgrad on clusters of two CTAs (each loading half of the shared x tile into both) sums every
// element as a single CTA does: bitwise equal results for every output, on grids of one cluster
// (all tiles in turn, so row tails follow each other in every stage: experts of 1 and 64 rows),
// an odd grid (rounded down to whole clusters) and larger ones; M = 320 is 3 M blocks, so the
// last cluster of each N block has a CTA past M.
TEST_F(GroupedGemmBackward, WgradClustersEqualSingleCtasBitwise) {
  constexpr GemmEngine kCooperative = GemmEngine::kCooperative;
  const size_t count = static_cast<size_t>(p_->num_experts) * kOut * kIn;
  std::vector<float> main_grad(count);
  const auto seed_values = random_bf16(count, 26, 4.0f);
  for (size_t i = 0; i < count; ++i) main_grad[i] = seed_values[i].to_float();
  const auto fp32 = run_wgrad<float>(WgradOutput::kFp32, 0, nullptr, kCooperative, 1);
  const auto bf16_result = run_wgrad<bf16>(WgradOutput::kBf16, 0, nullptr, kCooperative, 1);
  const auto accumulated =
      run_wgrad<float>(WgradOutput::kAccumulateFp32, 0, &main_grad, kCooperative, 1);
  for (int num_sms : {0, 2, 7, 33}) {
    EXPECT_TRUE(bitwise_equal(
        fp32, run_wgrad<float>(WgradOutput::kFp32, num_sms, nullptr, kCooperative, 2)))
        << "wgrad fp32: clusters on " << num_sms << " CTAs differ from single CTAs";
    EXPECT_TRUE(bitwise_equal(
        bf16_result, run_wgrad<bf16>(WgradOutput::kBf16, num_sms, nullptr, kCooperative, 2)))
        << "wgrad bf16: clusters on " << num_sms << " CTAs differ from single CTAs";
    EXPECT_TRUE(bitwise_equal(accumulated, run_wgrad<float>(WgradOutput::kAccumulateFp32, num_sms,
                                                            &main_grad, kCooperative, 2)))
        << "wgrad accumulate: clusters on " << num_sms << " CTAs differ from single CTAs";
  }
  // Single CTAs on other grids (their rounds rotate, tile_rounds.hpp): the same bits.
  for (int num_sms : {1, 2, 7, 200}) {
    EXPECT_TRUE(bitwise_equal(
        bf16_result, run_wgrad<bf16>(WgradOutput::kBf16, num_sms, nullptr, kCooperative, 1)))
        << "wgrad bf16: single CTAs on " << num_sms << " CTAs differ from the full grid";
  }
  EXPECT_THROW(run_wgrad<float>(WgradOutput::kFp32, 0, nullptr, kCooperative, 3), mok::Error);
}

// A call over a range of the experts (GroupedShape::expert_range, as a chunk of the low-memory
// backward makes: the experts outside given count -1, or their own counts): each expert of the
// range gets the whole call's result bitwise, everything else stays poisoned, on both engines,
// single CTAs and clusters, several grids; an empty range writes nothing; a range of every expert
// is the plain call.
TEST_F(GroupedGemmBackward, ExpertRangeComputesItsExpertsAlone) {
  const auto dx_all = run_dgrad(0, GemmEngine::kCooperative);
  const auto dw_all = run_wgrad<bf16>(p_->shape(), WgradOutput::kBf16, LaunchOptions{});
  const int experts = p_->num_experts;
  for (const auto& [first, end] : {std::pair{5, 17}, std::pair{0, 1}, std::pair{12, experts},
                                   std::pair{9, 9}, std::pair{0, experts}}) {
    DeviceBuffer<int> range(2);
    range.upload(std::vector<int>{first, end});
    std::vector<int> counts(kRowsPerExpert);
    for (int e = 0; e < experts; ++e) {
      if (e < first || e >= end) counts[e] = -1;
    }
    DeviceBuffer<int> chunk_counts(counts.size());
    chunk_counts.upload(counts);
    for (const bool negative : {false, true}) {
      GroupedShape shape = p_->shape();
      shape.expert_range = range.get();
      if (negative) shape.expert_counts = chunk_counts.get();
      for (const auto& [engine, num_sms, cluster] :
           {std::tuple{GemmEngine::kCooperative, 0, 0}, std::tuple{GemmEngine::kCooperative, 7, 1},
            std::tuple{GemmEngine::kPingpong, 0, 0}, std::tuple{GemmEngine::kPingpong, 3, 0}}) {
        SCOPED_TRACE(::testing::Message()
                     << "experts [" << first << ", " << end << "), counts "
                     << (negative ? "-1 outside" : "all") << ", engine " << static_cast<int>(engine)
                     << ", " << num_sms << " CTAs");
        const LaunchOptions options{num_sms, engine, cluster};
        const auto dx = run_dgrad(shape, p_->capacity, options);
        int64_t wrong = 0;
        for (int row = 0; row < p_->capacity; ++row) {
          const auto expert = std::upper_bound(p_->offsets.begin(), p_->offsets.end(), row) -
                              p_->offsets.begin() - 1;
          const bool inside = row < p_->total_rows && expert >= first && expert < end;
          for (int column = 0; column < kIn; ++column) {
            const size_t index = static_cast<size_t>(row) * kIn + column;
            wrong += inside ? (dx[index].bits != dx_all[index].bits ? 1 : 0)
                            : (is_poison(dx[index]) ? 0 : 1);
          }
        }
        EXPECT_EQ(wrong, 0) << "dgrad: elements not the whole call's inside the range, or "
                               "written outside it";
        const auto dw = run_wgrad<bf16>(shape, WgradOutput::kBf16, options);
        wrong = 0;
        for (int e = 0; e < experts; ++e) {
          const bool inside = e >= first && e < end;
          for (size_t i = static_cast<size_t>(e) * kOut * kIn;
               i < static_cast<size_t>(e + 1) * kOut * kIn; ++i) {
            wrong += inside ? (dw[i].bits != dw_all[i].bits ? 1 : 0) : (is_poison(dw[i]) ? 0 : 1);
          }
        }
        EXPECT_EQ(wrong, 0) << "wgrad: elements not the whole call's inside the range, or "
                               "written outside it";
      }
    }
  }
}

}  // namespace
}  // namespace mok::gemm_test
