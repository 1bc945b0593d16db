// mok::CommEngine, the public door to expert-parallel communication: a fresh random batch
// dispatched, passed through an identity "expert" (expert_y = expert_x) and combined gives
// y_t = sum_j w_tj * x_t, bit for bit what the host computes in the reduce's order, at EP 1 and
// EP 2, call after call; the schedule's row counts match the routing; a bad argument names itself.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "mok/comm.hpp"
#include "mok/gpu.hpp"
#include "test_comm_harness.cuh"

namespace mok::comm_test {
namespace {

#define MOK_REQUIRE_HOPPER_GPUS(count)                                             \
  do {                                                                             \
    const GpuSummary gpus_ = query_gpus();                                         \
    if (gpus_.num_hopper_gpus < (count)) {                                         \
      GTEST_SKIP() << "needs " << (count) << " Hopper GPU(s) for expert-parallel " \
                   << "communication; found: " << gpus_.description;               \
    }                                                                              \
  } while (0)

// H 256 (32 16-byte vectors per row), 16 experts, top-4: several rows per expert and padding.
const LayerShape kShape{256, 64, 0, 16, 4};

// One rank's call: x (T, H), topk_idx (T, k) with distinct ids and some unused (-1) slots,
// topk_w (T, k).
struct Batch {
  int64_t num_tokens = 0;
  std::vector<bf16> x;
  std::vector<int32_t> topk_idx;
  std::vector<float> topk_w;
};

Batch random_batch(int64_t num_tokens, uint64_t seed) {
  std::mt19937_64 generator(seed);
  std::uniform_real_distribution<float> value(-1.0f, 1.0f), weight(0.0f, 1.0f);
  Batch batch;
  batch.num_tokens = num_tokens;
  batch.x.resize(static_cast<size_t>(num_tokens * kShape.hidden));
  for (bf16& element : batch.x) element = bf16(value(generator));
  std::vector<int32_t> experts(static_cast<size_t>(kShape.num_experts));
  for (int64_t token = 0; token < num_tokens; ++token) {
    for (size_t expert = 0; expert < experts.size(); ++expert) {
      experts[expert] = static_cast<int32_t>(expert);
    }
    std::shuffle(experts.begin(), experts.end(), generator);
    for (int64_t slot = 0; slot < kShape.top_k; ++slot) {
      const bool unused = generator() % 8 == 0;
      batch.topk_idx.push_back(unused ? -1 : experts[static_cast<size_t>(slot)]);
      batch.topk_w.push_back(weight(generator));
    }
  }
  return batch;
}

// y (T, H) as the reduce computes it from slots that hold x_t: fp32, j in order, -1 slots skipped,
// one rounding to bf16.
std::vector<bf16> host_combine(const Batch& batch) {
  const int64_t hidden = kShape.hidden, top_k = kShape.top_k;
  std::vector<bf16> y(batch.x.size());
  for (int64_t token = 0; token < batch.num_tokens; ++token) {
    for (int64_t column = 0; column < hidden; ++column) {
      const float x = batch.x[static_cast<size_t>(token * hidden + column)].to_float();
      float sum = 0.0f;
      for (int64_t slot = 0; slot < top_k; ++slot) {
        if (batch.topk_idx[static_cast<size_t>(token * top_k + slot)] < 0) continue;
        // NOTE: volatile keeps the host compiler from fusing the multiply into the add (an FMA
        // rounds once; the device rounds twice).
        volatile float product = batch.topk_w[static_cast<size_t>(token * top_k + slot)] * x;
        sum = sum + product;
      }
      volatile float total = sum + 0.0f;  // the reduce adds the (absent) shared output
      y[static_cast<size_t>(token * hidden + column)] = bf16(total);
    }
  }
  return y;
}

// Rows each local expert of `rank` receives from every rank's batch.
std::vector<int32_t> host_counts(const std::vector<Batch>& batches, int rank) {
  const int64_t experts_local = kShape.num_experts / static_cast<int64_t>(batches.size());
  std::vector<int32_t> counts(static_cast<size_t>(experts_local), 0);
  for (const Batch& batch : batches) {
    for (int32_t expert : batch.topk_idx) {
      if (expert >= 0 && expert / experts_local == rank) ++counts[expert % experts_local];
    }
  }
  return counts;
}

// `calls` calls on engines made for `devices`, each on a fresh random batch of tokens[rank]
// tokens per rank, with every output poisoned first.
void expect_round_trips(const std::vector<int>& devices, const std::vector<int64_t>& tokens,
                        int64_t tokens_max, const CommCopyConfig& copy, int calls) {
  const int ep = static_cast<int>(devices.size());
  const std::vector<std::unique_ptr<CommEngine>> engines =
      CommEngine::create_local(devices, kShape, tokens_max);
  const int64_t row_bytes = kShape.hidden * static_cast<int64_t>(sizeof(bf16));
  for (int call = 0; call < calls; ++call) {
    std::vector<Batch> batches;
    for (int rank = 0; rank < ep; ++rank) {
      batches.push_back(random_batch(tokens[rank], 1000 * call + rank));
    }
    CommEngine::for_each_rank(ep, [&](int rank) {
      CommEngine& engine = *engines[rank];
      ASSERT_EQ(engine.rank(), rank);
      ASSERT_EQ(engine.num_ranks(), ep);
      MOK_CUDA_CHECK(cudaSetDevice(engine.device()));
      const Batch& batch = batches[rank];
      DeviceBuffer<bf16> x(batch.x), y(batch.x.size());
      DeviceBuffer<int32_t> topk_idx(batch.topk_idx);
      DeviceBuffer<float> topk_w(batch.topk_w);
      y.poison();
      const size_t rows_bytes = static_cast<size_t>(engine.rows_capacity() * row_bytes);
      MOK_CUDA_CHECK(cudaMemset(engine.x(), 0xff, engine.tokens_max() * row_bytes));
      MOK_CUDA_CHECK(cudaMemset(engine.expert_x(), 0xff, rows_bytes));
      MOK_CUDA_CHECK(cudaMemset(engine.expert_y(), 0xff, rows_bytes));
      cudaStream_t stream = nullptr;
      MOK_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
      engine.stage_tokens(x.get(), batch.num_tokens, stream);
      engine.schedule(topk_idx.get(), batch.num_tokens, stream);
      engine.dispatch(copy, stream);
      // The identity expert: every row goes back as it came (padding rows stay NaN, unread).
      MOK_CUDA_CHECK(cudaMemcpyAsync(engine.expert_y(), engine.expert_x(), rows_bytes,
                                     cudaMemcpyDeviceToDevice, stream));
      engine.combine_push(copy, stream);
      engine.combine_reduce(topk_w.get(), y.get(), batch.num_tokens, stream);
      engine.check(stream);
      MOK_CUDA_CHECK(cudaStreamDestroy(stream));

      const int64_t experts_local = kShape.num_experts / ep;
      std::vector<int32_t> counts(static_cast<size_t>(experts_local));
      MOK_CUDA_CHECK(cudaMemcpy(counts.data(), engine.expert_counts(), counts.size() * 4,
                                cudaMemcpyDeviceToHost));
      EXPECT_EQ(counts, host_counts(batches, rank)) << "rank " << rank << " call " << call;
      const int64_t differs = first_difference(y.download(), host_combine(batch));
      EXPECT_EQ(differs, -1) << "rank " << rank << " call " << call << ": y differs at element "
                             << differs << " (token " << differs / kShape.hidden << ")";
    });
  }
}

template <class Call>
void expect_error_naming(const std::string& argument, Call&& call) {
  try {
    call();
    ADD_FAILURE() << "a bad " << argument << " was accepted";
  } catch (const Error& error) {
    EXPECT_EQ(error.argument(), argument) << error.what();
  }
}

TEST(CommEngine, RoundTripAtEp1) {
  MOK_REQUIRE_HOPPER_GPUS(1);
  expect_round_trips({0}, {300}, 320, {}, 2);
  expect_round_trips({0}, {77}, 77, {3, 96}, 1);  // 3 warps per CTA on 3 CTAs
}

TEST(CommEngine, RoundTripAtEp2) {
  MOK_REQUIRE_HOPPER_GPUS(2);
  expect_round_trips({0, 1}, {300, 129}, 320, {}, 2);  // ranks with different token counts
  expect_round_trips({0, 1}, {64, 64}, 64, {4, 128}, 1);
}

// No GPU needed: the devices are checked first.
TEST(CommEngine, BadDevicesNameTheArgument) {
  expect_error_naming("devices", [] { CommEngine::create_local({}, kShape, 64); });
  expect_error_naming("devices", [] { CommEngine::create_local({-1}, kShape, 64); });
  expect_error_naming("devices", [] { CommEngine::create_local({0, 0}, kShape, 64); });
}

TEST(CommEngine, BadArgumentsNameThemselves) {
  MOK_REQUIRE_HOPPER_GPUS(1);
  expect_error_naming("tokens_max", [] { CommEngine::create_local({0}, kShape, 0); });
  CommEngineOptions options;
  options.block_m = 0;
  expect_error_naming("block_m", [&] { CommEngine::create_local({0}, kShape, 64, options); });
  const std::vector<std::unique_ptr<CommEngine>> engines =
      CommEngine::create_local({0}, kShape, 64);
  CommEngine& engine = *engines[0];
  MOK_CUDA_CHECK(cudaSetDevice(engine.device()));
  DeviceBuffer<int32_t> topk_idx(64 * kShape.top_k);
  DeviceBuffer<float> topk_w(64 * kShape.top_k);
  DeviceBuffer<bf16> y(64 * kShape.hidden + 8);
  expect_error_naming("num_tokens", [&] { engine.schedule(topk_idx.get(), 65, nullptr); });
  expect_error_naming("topk_idx", [&] { engine.schedule(nullptr, 8, nullptr); });
  expect_error_naming("x", [&] { engine.stage_tokens(nullptr, 8, nullptr); });
  expect_error_naming("threads_per_cta", [&] { engine.dispatch({4, 48}, nullptr); });
  expect_error_naming("num_ctas", [&] { engine.combine_push({-1, 128}, nullptr); });
  expect_error_naming("y", [&] {
    engine.combine_reduce(topk_w.get(), y.get() + 1, 8, nullptr);  // 2-byte aligned
  });
  expect_error_naming("num_ranks", [] { CommEngine::for_each_rank(-1, [](int) {}); });
}

}  // namespace
}  // namespace mok::comm_test
