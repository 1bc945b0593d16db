#include <gtest/gtest.h>

#include "helpers.hpp"
#include "reference/schedule.hpp"

namespace mok {
namespace {

TEST(Schedule, RowsOfEachExpertAreInGlobalTokenOrder) {
  const Problem problem =
      Problem::generate({testing::tiny_shape(), 64, Routing::parse("skewed:1"), 3, false, 0.2});
  const std::vector<reference::RankInputs> ranks = problem.all_rank_inputs(4);
  std::vector<TokenBatch> batches;
  for (const auto& rank : ranks) batches.push_back(rank.tokens);
  const reference::ExpertSchedule schedule = reference::build_schedule(problem.shape, batches);

  int64_t used_slots = 0;
  for (int32_t expert : problem.topk_idx) used_slots += expert >= 0;
  ASSERT_EQ(static_cast<int64_t>(schedule.rows.size()), used_slots);
  for (int64_t expert = 0; expert < problem.shape.num_experts; ++expert) {
    for (int64_t row = schedule.offsets[expert]; row < schedule.offsets[expert + 1]; ++row) {
      const reference::RowRef ref = schedule.rows[row];
      const int64_t global_token = ref.rank * 16 + ref.token;  // 64 tokens over 4 ranks
      EXPECT_EQ(problem.topk_idx[global_token * problem.shape.top_k + ref.slot], expert);
      if (row > schedule.offsets[expert]) {
        const reference::RowRef previous = schedule.rows[row - 1];
        EXPECT_LT(previous.rank * 16 + previous.token, global_token) << "expert " << expert;
      }
    }
  }
}

TEST(Synthetic, RoutingsHaveTheirShape) {
  const LayerShape shape = testing::tiny_shape();
  const Problem single = Problem::generate({shape, 40, Routing::parse("single-expert"), 1});
  for (int64_t token = 0; token < 40; ++token) {
    EXPECT_EQ(single.topk_idx[token * shape.top_k], 0);
    EXPECT_EQ(single.topk_w[token * shape.top_k], 1.0f);  // softmax over one used slot
    for (int64_t slot = 1; slot < shape.top_k; ++slot)
      EXPECT_EQ(single.topk_idx[token * shape.top_k + slot], -1);
  }
  const Problem skewed = Problem::generate({shape, 400, Routing::parse("skewed:2"), 1});
  std::vector<int64_t> counts(shape.num_experts, 0);
  for (int32_t expert : skewed.topk_idx) ++counts[expert];
  EXPECT_GT(counts[0], 3 * counts[shape.num_experts - 1]);
  EXPECT_GT(counts[0], 380);  // with alpha = 2 and k = 4, expert 0 is in nearly every row
}

}  // namespace
}  // namespace mok
