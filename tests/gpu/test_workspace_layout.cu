// The workspace layout is host/device arithmetic only: checked here without a GPU (these tests
// run in CI), for the shapes the benchmarks use and small odd ones.
#include <gtest/gtest.h>

#include <algorithm>
#include <utility>
#include <vector>

#include "kernels/comm/workspace_layout.cuh"

namespace mok::comm {
namespace {

struct Region {
  const char* name;
  int64_t offset;
  int64_t bytes;  // what the region must hold
};

// Regions in order, each aligned, each large enough, none overlapping, all inside `total`.
void expect_disjoint_and_aligned(std::vector<Region> regions, int64_t total) {
  std::sort(regions.begin(), regions.end(),
            [](const Region& a, const Region& b) { return a.offset < b.offset; });
  for (size_t index = 0; index < regions.size(); ++index) {
    const Region& region = regions[index];
    EXPECT_EQ(region.offset % kRegionAlignment, 0) << region.name;
    const int64_t end = region.offset + region.bytes;
    if (index + 1 < regions.size()) {
      EXPECT_LE(end, regions[index + 1].offset)
          << region.name << " runs into " << regions[index + 1].name;
    } else {
      EXPECT_LE(end, total) << region.name << " runs past the end";
    }
  }
}

class Layout : public ::testing::TestWithParam<std::vector<int64_t>> {};

TEST_P(Layout, RegionsAreDisjointAlignedAndLargeEnough) {
  const std::vector<int64_t>& p = GetParam();  // ranks, T_max, H, k, E, block_m
  const WorkspaceLayout layout =
      WorkspaceLayout::make(static_cast<int32_t>(p[0]), p[1], p[2], p[3], p[4], p[5]);
  const int64_t ranks = p[0], tokens = p[1], hidden = p[2], top_k = p[3], block_m = p[5];
  const int64_t local_experts = layout.experts_per_rank();
  EXPECT_EQ(local_experts, p[4] / ranks);
  EXPECT_EQ(layout.row_bytes(), 2 * hidden);
  // Worst case: every token of every rank sends all k rows here, and each expert pads its last
  // tile.
  EXPECT_EQ(layout.rows_capacity(), ranks * tokens * top_k + local_experts * (block_m - 1));
  // Every (t, j) has a slot, except at EP 1 with expert_y, where the reduce reads the rows there.
  EXPECT_EQ(layout.slot_rows, ranks == 1 ? 0 : tokens * top_k);  // (make's default: expert_y)
  EXPECT_EQ(WorkspaceLayout::make(static_cast<int32_t>(ranks), tokens, hidden, top_k, p[4], block_m,
                                  0, /*with_expert_y=*/false)
                .slot_rows,
            tokens * top_k);

  expect_disjoint_and_aligned(
      {{"flags", layout.flags_offset, int64_t{kNumFlagKinds} * kMaxRanks * 4},
       {"token_counts", layout.token_counts_offset, int64_t{kMaxRanks} * 4},
       {"topk", layout.topk_offset, ranks * tokens * top_k * 4},
       {"x", layout.x_offset, tokens * 2 * hidden},
       {"slots", layout.slots_offset, layout.slot_rows * 2 * hidden}},
      layout.window_bytes);
  expect_disjoint_and_aligned(
      {{"state", layout.state_offset, static_cast<int64_t>(sizeof(DeviceState))},
       {"counts", layout.counts_offset, local_experts * 4},
       {"slice_rows", layout.slice_rows_offset,
        ranks * ((tokens * top_k + kScheduleSlice - 1) / kScheduleSlice) * local_experts * 4},
       {"offsets", layout.offsets_offset, (local_experts + 1) * 4},
       {"row_source", layout.row_source_offset, layout.rows_capacity() * 4},
       {"local_row", layout.local_row_offset, tokens * top_k * 4},
       {"task_counters", layout.task_counters_offset,
        kNumTaskCounters *
            ((std::max(layout.rows_capacity(), tokens) + layout.block_m - 1) / layout.block_m) * 4},
       {"expert_x", layout.expert_x_offset, layout.rows_capacity() * 2 * hidden},
       {"expert_y", layout.expert_y_offset, layout.rows_capacity() * 2 * hidden}},
      layout.local_bytes);
}

TEST(LayoutWindow, SameShapesGiveTheSameWindowOnEveryRank) {
  // Peers address each other's windows with this rank's offsets: they must not depend on anything
  // but the shapes.
  const WorkspaceLayout a = WorkspaceLayout::make(2, 8192, 7168, 8, 256, 128);
  const WorkspaceLayout b = WorkspaceLayout::make(2, 8192, 7168, 8, 256, 128);
  EXPECT_EQ(a.window_bytes, b.window_bytes);
  EXPECT_EQ(a.slots_offset, b.slots_offset);
  EXPECT_EQ(a.x_offset, b.x_offset);
}

TEST(LayoutBackward, OneRanksRowsShareExpertDy) {
  // One rank's backward (rows_in_expert_dy): no slots, x or dy rows in the window; slot (t, j) is
  // expert_dy row t * k + j, inside its rows_capacity rows, and expert_x is expert_dy.
  const int64_t tokens = 5, hidden = 8, top_k = 3;
  const WorkspaceLayout plain = WorkspaceLayout::make(1, tokens, hidden, top_k, 4, 64, 0,
                                                      /*with_expert_y=*/false,
                                                      /*with_backward=*/true);
  const WorkspaceLayout layout = WorkspaceLayout::make(1, tokens, hidden, top_k, 4, 64, 0,
                                                       /*with_expert_y=*/false,
                                                       /*with_backward=*/true,
                                                       /*rows_in_expert_dy=*/true);
  EXPECT_EQ(plain.slot_rows, tokens * top_k);
  EXPECT_EQ(layout.slot_rows, 0);
  EXPECT_EQ(layout.expert_rows, layout.rows_capacity());
  // The window keeps flags, counts, ids, topk_w and d_topk_w only.
  EXPECT_EQ(layout.x_offset, layout.slots_offset);
  EXPECT_EQ(layout.slots_offset, layout.dy_offset);
  EXPECT_LE(layout.window_bytes,
            plain.window_bytes - 3 * align_up(tokens * hidden * 2, kRegionAlignment));
  // The local buffer has no rows of expert_x of its own.
  EXPECT_EQ(layout.expert_x_offset, layout.expert_dy_offset);
  EXPECT_LE(layout.local_bytes,
            plain.local_bytes - layout.rows_capacity() * layout.row_bytes() + 4096);
  ASSERT_GE(layout.rows_capacity(), tokens * top_k);
  std::vector<char> window(static_cast<size_t>(layout.window_bytes));
  std::vector<char> local(static_cast<size_t>(layout.local_bytes));
  WorkspaceView view;
  view.layout = layout;
  view.windows[0] = window.data();
  view.local = local.data();
  for (int64_t token = 0; token < tokens; ++token) {
    for (int64_t slot = 0; slot < top_k; ++slot) {
      EXPECT_EQ(view.slot_row(0, token, slot), view.expert_dy_row(token * top_k + slot));
    }
  }
  for (int64_t row = 0; row < layout.rows_capacity(); row += 7) {
    EXPECT_EQ(view.expert_x_row(row), view.expert_dy_row(row));
  }
  EXPECT_LE(view.expert_dy_row(layout.rows_capacity()), local.data() + local.size());
}

TEST(RowSource, UnpackInvertsPackUpToTheLargestPackedValue) {
  // The sources of every rank's first and last tokens and slots, for the bench shapes and for a
  // shape whose packed values reach just below 2^31 (the workspace's limit).
  const WorkspaceLayout shapes[] = {WorkspaceLayout::make(2, 8192, 7168, 8, 256, 128),
                                    WorkspaceLayout::make(8, 173, 256, 3, 16, 128),
                                    WorkspaceLayout::make(4, 67108863, 8, 8, 8, 64)};
  for (const WorkspaceLayout& layout : shapes) {
    ASSERT_LT(layout.num_ranks * layout.tokens_max * layout.top_k, int64_t{1} << 31);
    for (int rank = 0; rank < layout.num_ranks; ++rank) {
      for (const int64_t token : {int64_t{0}, int64_t{1}, layout.tokens_max - 1}) {
        for (const int64_t slot : {int64_t{0}, int64_t{layout.top_k - 1}}) {
          const RowSource source =
              unpack_row_source(layout, pack_row_source(layout, rank, token, slot));
          EXPECT_EQ(source.rank, rank);
          EXPECT_EQ(source.token, token);
          EXPECT_EQ(source.slot, slot);
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, Layout,
    ::testing::Values(std::vector<int64_t>{2, 8192, 7168, 8, 256, 128},   // deepseek-v3, EP 2
                      std::vector<int64_t>{1, 8192, 7168, 8, 256, 128},   // deepseek-v3, EP 1
                      std::vector<int64_t>{2, 16384, 2048, 8, 128, 128},  // qwen3-30b-a3b
                      std::vector<int64_t>{8, 173, 256, 4, 16, 128},      // odd token count
                      std::vector<int64_t>{2, 1, 8, 1, 2, 64}));          // smallest

}  // namespace
}  // namespace mok::comm
