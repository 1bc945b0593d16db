// Forward grouped GEMM y_e = x_e · W_eᵀ and its SwiGLU-fused variant against host references:
// experts with 0, 1, 127, 128, 129 and thousands of rows, K and N not multiples of the tile,
// every output poisoned before each run, repeated and differently-sized grids bitwise equal.
#include <algorithm>
#include <vector>

#include "gemm_test_support.hpp"
#include "mok/detail/numerics.hpp"
#include "mok/gemm.hpp"

namespace mok::gemm_test {
namespace {

using namespace mok::gemm;

constexpr int kHidden = 328;                    // K: 5 full k-blocks of 64 and a partial one
constexpr int kIntermediate = 160;              // SwiGLU output width
constexpr int kFusedWidth = 2 * kIntermediate;  // N = 320: one full N tile and a partial one
// A group's last row block with at most 64 rows runs as a half tile (is_half_tile): 1, 129, 2100
// (52 rows past 2048), 64 and 192 do, 127, 65 and 193 do not.
const std::vector<int> kRowsPerExpert = {0, 1, 127, 128, 129, 2100, 0, 64, 65, 192, 193};
constexpr int kSpareRows = 37;  // capacity past the last expert: must stay untouched

struct ForwardProblem {
  int num_experts = static_cast<int>(kRowsPerExpert.size());
  std::vector<int> offsets = offsets_of(kRowsPerExpert);
  int total_rows = offsets.back();
  int capacity = total_rows + kSpareRows;
  std::vector<bf16> x = random_bf16(static_cast<size_t>(capacity) * kHidden, 11);
  std::vector<bf16> gate =
      random_bf16(static_cast<size_t>(num_experts) * kIntermediate * kHidden, 12);
  std::vector<bf16> up =
      random_bf16(static_cast<size_t>(num_experts) * kIntermediate * kHidden, 13);
  std::vector<bf16> w = interleave_gate_up(gate, up, num_experts, kIntermediate, kHidden);

  GroupedShape shape() const { return {num_experts, capacity, kFusedWidth, kHidden}; }
  int expert_of(int row) const {
    return static_cast<int>(std::upper_bound(offsets.begin(), offsets.end(), row) -
                            offsets.begin()) -
           1;
  }
};

// fp64 oracle and fp32-accumulate host result of y = x · Wᵀ over the rows of every expert.
struct ForwardReference {
  std::vector<double> oracle;
  std::vector<float> same_precision;
  std::vector<bool> written;

  explicit ForwardReference(const ForwardProblem& p) {
    const size_t count = static_cast<size_t>(p.capacity) * kFusedWidth;
    oracle.assign(count, 0.0);
    same_precision.assign(count, 0.0f);
    written.assign(count, false);
    std::vector<float> x(p.x.size()), w(p.w.size());
    for (size_t i = 0; i < x.size(); ++i) x[i] = p.x[i].to_float();
    for (size_t i = 0; i < w.size(); ++i) w[i] = p.w[i].to_float();
    for (int row = 0; row < p.total_rows; ++row) {
      const int expert = p.expert_of(row);
      const float* x_row = &x[static_cast<size_t>(row) * kHidden];
      for (int column = 0; column < kFusedWidth; ++column) {
        const float* w_row = &w[(static_cast<size_t>(expert) * kFusedWidth + column) * kHidden];
        double sum64 = 0.0;
        float sum32 = 0.0f;
        for (int k = 0; k < kHidden; ++k) {
          sum64 += static_cast<double>(x_row[k]) * w_row[k];
          sum32 = numerics::add_rn(sum32, numerics::mul_rn(x_row[k], w_row[k]));
        }
        const size_t index = static_cast<size_t>(row) * kFusedWidth + column;
        oracle[index] = sum64;
        same_precision[index] = sum32;
        written[index] = true;
      }
    }
  }
};

class GroupedGemmForward : public ::testing::Test {
 protected:
  void SetUp() override {
    MOK_REQUIRE_HOPPER();
    problem_ = std::make_unique<ForwardProblem>();
    x_ = std::make_unique<DeviceBuffer<bf16>>(problem_->x.size());
    w_ = std::make_unique<DeviceBuffer<bf16>>(problem_->w.size());
    offsets_ = std::make_unique<DeviceBuffer<int>>(problem_->offsets.size());
    x_->upload(problem_->x);
    w_->upload(problem_->w);
    offsets_->upload(problem_->offsets);
  }

  template <class T>
  std::vector<T> run(ForwardOutput output, int width, int num_sms = 0,
                     GemmEngine engine = GemmEngine::kAuto) {
    DeviceBuffer<T> y(static_cast<size_t>(problem_->capacity) * width);
    y.poison();
    grouped_forward(problem_->shape(), x_->get(), w_->get(), offsets_->get(), y.get(), output,
                    nullptr, LaunchOptions{num_sms, engine});
    MOK_CUDA_CHECK(cudaDeviceSynchronize());
    return y.download();
  }

  std::unique_ptr<ForwardProblem> problem_;
  std::unique_ptr<DeviceBuffer<bf16>> x_, w_;
  std::unique_ptr<DeviceBuffer<int>> offsets_;
};

TEST_F(GroupedGemmForward, Bf16MatchesReference) {
  const ForwardReference reference(*problem_);
  std::vector<float> host_bf16(reference.same_precision.size());
  for (size_t i = 0; i < host_bf16.size(); ++i)
    host_bf16[i] = round_to_bf16(reference.same_precision[i]);
  const auto y = run<bf16>(ForwardOutput::kBf16, kFusedWidth);
  expect_accuracy(y, host_bf16, reference.oracle, reference.written, 2.0, "forward bf16");
  const auto again = run<bf16>(ForwardOutput::kBf16, kFusedWidth);
  EXPECT_TRUE(bitwise_equal(y, again)) << "forward bf16: repeated runs differ";
  const auto few_sms = run<bf16>(ForwardOutput::kBf16, kFusedWidth, 3);
  EXPECT_TRUE(bitwise_equal(y, few_sms)) << "forward bf16: 3-CTA grid differs from full grid";
}

TEST_F(GroupedGemmForward, Fp32MatchesReference) {
  const ForwardReference reference(*problem_);
  const auto y = run<float>(ForwardOutput::kFp32, kFusedWidth);
  expect_accuracy(y, reference.same_precision, reference.oracle, reference.written, 4.0,
                  "forward fp32");
  const auto one_sm = run<float>(ForwardOutput::kFp32, kFusedWidth, 1);
  EXPECT_TRUE(bitwise_equal(y, one_sm)) << "forward fp32: 1-CTA grid differs from full grid";
}

// The fused epilogue must equal the unfused composition bitwise: fp32 GEMM on the device, then
// h = bf16(swiglu(g, u)) with the shared host/device scalar definition.
TEST_F(GroupedGemmForward, SwiGluFusedEqualsUnfusedBitwise) {
  const auto y = run<float>(ForwardOutput::kFp32, kFusedWidth);
  const auto h = run<bf16>(ForwardOutput::kSwiGluBf16, kIntermediate);
  const ForwardReference reference(*problem_);
  const size_t count = static_cast<size_t>(problem_->capacity) * kIntermediate;
  std::vector<double> oracle(count, 0.0);
  std::vector<float> host(count, 0.0f);
  std::vector<bool> written(count, false);
  size_t mismatches = 0;
  for (int row = 0; row < problem_->capacity; ++row) {
    for (int i = 0; i < kIntermediate; ++i) {
      const size_t index = static_cast<size_t>(row) * kIntermediate + i;
      if (row >= problem_->total_rows) {
        mismatches += is_poison(h[index]) ? 0 : 1;
        continue;
      }
      // Fused column of gate i and of up i.
      const size_t gate = static_cast<size_t>(row) * kFusedWidth + (i / 8) * 16 + i % 8;
      const size_t up = gate + 8;
      const bf16 unfused(numerics::swiglu(y[gate], y[up]));
      mismatches += unfused.bits == h[index].bits ? 0 : 1;
      oracle[index] = numerics::swiglu(reference.oracle[gate], reference.oracle[up]);
      host[index] = round_to_bf16(
          numerics::swiglu(reference.same_precision[gate], reference.same_precision[up]));
      written[index] = true;
    }
  }
  EXPECT_EQ(mismatches, 0u) << "SwiGLU fused epilogue differs from GEMM + swiglu";
  expect_accuracy(h, host, oracle, written, 2.0, "forward SwiGLU");
}

// Both engines sum every element over the same k-blocks in the same order: bitwise equal results
// for every output kind, whatever the grid (the ping-pong one on 1 and 3 CTAs: both consumers
// of one CTA taking turns over every tile, and an odd tile count per CTA).
TEST_F(GroupedGemmForward, PingpongEqualsCooperativeBitwise) {
  constexpr GemmEngine kCooperative = GemmEngine::kCooperative;
  const auto bf16_result = run<bf16>(ForwardOutput::kBf16, kFusedWidth, 0, kCooperative);
  const auto fp32_result = run<float>(ForwardOutput::kFp32, kFusedWidth, 0, kCooperative);
  const auto swiglu_result = run<bf16>(ForwardOutput::kSwiGluBf16, kIntermediate, 0, kCooperative);
  constexpr GemmEngine kPingpong = GemmEngine::kPingpong;
  for (int num_sms : {0, 1, 3}) {
    EXPECT_TRUE(bitwise_equal(bf16_result,
                              run<bf16>(ForwardOutput::kBf16, kFusedWidth, num_sms, kPingpong)))
        << "forward bf16: ping-pong on " << num_sms << " CTAs differs from cooperative";
    EXPECT_TRUE(bitwise_equal(fp32_result,
                              run<float>(ForwardOutput::kFp32, kFusedWidth, num_sms, kPingpong)))
        << "forward fp32: ping-pong on " << num_sms << " CTAs differs from cooperative";
    EXPECT_TRUE(bitwise_equal(
        swiglu_result, run<bf16>(ForwardOutput::kSwiGluBf16, kIntermediate, num_sms, kPingpong)))
        << "forward SwiGLU: ping-pong on " << num_sms << " CTAs differs from cooperative";
  }
}

}  // namespace
}  // namespace mok::gemm_test
