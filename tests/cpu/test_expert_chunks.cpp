// How a chunked backward cuts the routed experts into chunks (kernels/megakernel/
// expert_chunk_plan.hpp), on the host: the chunks take every expert once, in order, each within
// its capacity, and never more of them than expert_chunk_bound, which the host enqueues without
// knowing the routing; routings drawn as the layer's are (distinct experts per token).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

#include "kernels/megakernel/expert_chunk_plan.hpp"

namespace mok::megakernel {
namespace {

// Rows of each of `experts` experts when each of `tokens` tokens picks top_k distinct ones, a
// share of them (skew > 0) from the first few experts.
std::vector<int32_t> draw_counts(int tokens, int top_k, int experts, double skew,
                                 std::mt19937& random) {
  std::vector<int32_t> counts(static_cast<size_t>(experts), 0);
  std::vector<int> order(static_cast<size_t>(experts));
  std::iota(order.begin(), order.end(), 0);
  std::uniform_real_distribution<double> uniform(0.0, 1.0);
  for (int token = 0; token < tokens; ++token) {
    std::shuffle(order.begin(), order.end(), random);
    if (uniform(random) < skew)
      std::sort(order.begin(), order.begin() + std::min(experts, 2 * top_k));
    for (int slot = 0; slot < top_k; ++slot) ++counts[static_cast<size_t>(order[slot])];
  }
  return counts;
}

// The chunks enqueued for a call, checked: experts in order, once each; every non-empty chunk
// within capacity; the chunks past the last empty. Returns the non-empty chunks.
int64_t expect_valid_chunks(const std::vector<int32_t>& counts, int tokens, int top_k,
                            int64_t capacity) {
  const auto experts = static_cast<int32_t>(counts.size());
  const int64_t bound = expert_chunk_bound(tokens, top_k, experts, capacity);
  EXPECT_GE(bound, 1);
  int32_t next = 0;
  int64_t used = 0;
  for (int32_t index = 0; index < bound + 2; ++index) {
    const ExpertRange range = expert_chunk_range(counts.data(), experts, index, capacity);
    if (range.first == range.end) {
      EXPECT_EQ(range.first, experts) << "an empty chunk names no expert";
      continue;
    }
    EXPECT_EQ(range.first, next) << "chunk " << index << " skips or repeats experts";
    EXPECT_LT(index, bound) << "a chunk past the enqueued ones";
    int64_t rows = 0;
    for (int32_t expert = range.first; expert < range.end; ++expert) rows += counts[expert];
    EXPECT_LE(rows, capacity) << "chunk " << index;
    next = range.end;
    ++used;
  }
  EXPECT_EQ(next, experts) << "experts no chunk took";
  return used;
}

TEST(ExpertChunks, EveryExpertOnceWithinCapacityAndBound) {
  std::mt19937 random(2026);
  struct Case {
    int tokens, top_k, experts;
    double skew;
  };
  for (const Case& c : {Case{77, 6, 16, 0.0}, Case{300, 4, 64, 0.5}, Case{1, 8, 128, 0.0},
                        Case{512, 8, 128, 0.9}, Case{100, 1, 8, 1.0}, Case{64, 2, 2, 0.0}}) {
    for (int64_t capacity : {int64_t{c.tokens}, int64_t{c.tokens + c.tokens / 2},
                             int64_t{2} * c.tokens, int64_t{c.tokens} * c.top_k}) {
      SCOPED_TRACE(::testing::Message() << c.tokens << " tokens, top-" << c.top_k << ", "
                                        << c.experts << " experts, capacity " << capacity);
      for (int draw = 0; draw < 20; ++draw) {
        expect_valid_chunks(draw_counts(c.tokens, c.top_k, c.experts, c.skew, random), c.tokens,
                            c.top_k, capacity);
      }
    }
  }
}

TEST(ExpertChunks, WorstCasesReachNoFurtherThanTheBound) {
  // 100 tokens, top-8, capacity 1.5 T (spare S = 50): experts of T and S + 1 rows in turn (5 take
  // every token, 6 share the other 3 slots), so no two fit in a chunk but the last two (51 + 45):
  // 10 chunks, under the bound min(ceil(T k / S), 2 ceil(T k / capacity) - 1) = min(16, 11).
  const int tokens = 100, top_k = 8;
  const int64_t capacity = tokens + tokens / 2;
  std::vector<int32_t> alternating;
  for (int pair = 0; pair < 5; ++pair) alternating.insert(alternating.end(), {100, 51});
  alternating.push_back(800 - 5 * 151);
  EXPECT_EQ(expect_valid_chunks(alternating, tokens, top_k, capacity), 10);
  EXPECT_EQ(expert_chunk_bound(tokens, top_k, 10, capacity), 10);  // (no more than experts)
  EXPECT_EQ(expert_chunk_bound(tokens, top_k, 64, capacity), 11);
  // A large spare: its own bound is the tighter (T k = 800, capacity 790: ceil(800 / 690) = 2).
  EXPECT_EQ(expert_chunk_bound(tokens, top_k, 64, 790), 2);
  // Everything fits: one chunk; no token: one (the wgrads' zeros).
  EXPECT_EQ(expert_chunk_bound(tokens, top_k, 16, int64_t{tokens} * top_k), 1);
  EXPECT_EQ(expert_chunk_bound(0, top_k, 16, 1), 1);
  EXPECT_EQ(expert_chunk_bound(tokens, 1, 1, tokens), 1);
  // No spare rows (capacity T): two chunks in a row still hold more than T rows.
  EXPECT_EQ(expert_chunk_bound(tokens, top_k, 64, tokens), 15);
  EXPECT_EQ(expert_chunk_bound(tokens, top_k, 12, tokens), 12);
}

// Every routing of a few tokens: any rows per expert up to T (T tokens with k distinct experts
// each can give any such counts summing to T k; -1 slots give less), every capacity from T up:
// the packing never makes more chunks than the bound, and the bound is reached at some routing.
TEST(ExpertChunks, BoundHoldsForEveryRoutingOfFewTokens) {
  const int tokens = 4, top_k = 3, experts = 6;
  for (int64_t capacity = tokens; capacity <= tokens * top_k; ++capacity) {
    SCOPED_TRACE(::testing::Message() << "capacity " << capacity);
    const int64_t bound = expert_chunk_bound(tokens, top_k, experts, capacity);
    int64_t most = 0;
    std::vector<int32_t> counts(experts, 0);
    for (;;) {
      const int sum = std::accumulate(counts.begin(), counts.end(), 0);
      if (sum <= tokens * top_k) {
        int64_t chunks = 0;
        while (expert_chunk_range(counts.data(), experts, static_cast<int32_t>(chunks), capacity)
                   .first != experts) {
          ++chunks;
        }
        most = std::max(most, chunks);
        ASSERT_LE(chunks, bound) << "counts " << ::testing::PrintToString(counts);
      }
      int digit = 0;  // the next vector of counts in [0, T]^E
      while (digit < experts && counts[digit] == tokens) counts[digit++] = 0;
      if (digit == experts) break;
      ++counts[digit];
    }
    // (at these sizes some routing reaches the bound, or one chunk short of it: capacities 5, 8
    // and 9)
    EXPECT_GE(most, bound - 1) << "the bound is loose by more than one chunk";
  }
}

}  // namespace
}  // namespace mok::megakernel
