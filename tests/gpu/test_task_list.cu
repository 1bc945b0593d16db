// The fused forward's task list (kernels/megakernel/task_list.cuh) is host/device arithmetic:
// checked here without a GPU (these tests run in CI). Every tile of the four GEMMs is decoded from
// exactly one ticket, with the fields the mainloop and epilogue need, every task comes after the
// tasks it waits for (the order that rules out deadlock, ring rounds included), and a ticket
// decodes the same whatever tickets a CTA saw before it; carried tails go with the right tiles.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <ostream>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "kernels/megakernel/task_list.cuh"

namespace mok::megakernel {
namespace {

constexpr int kRows = gemm::TileConfig::BLOCK_M;

struct ListCase {
  const char* name;
  std::vector<int32_t> counts;  // rows of each local expert
  int shared_mblocks;
  int minibatch_mblocks;
  int n_blocks[kNumTaskKinds];
  int ring_mblocks;  // 0: one round (a ring as large as every row block)
};

struct Routed {
  std::vector<int32_t> offsets;  // (E + 1), each expert starting at a multiple of 128
  int mblocks = 0;
};

void PrintTo(const ListCase& which, std::ostream* out) { *out << which.name; }

Routed lay_out(const std::vector<int32_t>& counts) {
  Routed routed;
  routed.offsets.push_back(0);
  for (int32_t count : counts) {
    routed.offsets.push_back(routed.offsets.back() + (count + kRows - 1) / kRows * kRows);
  }
  routed.mblocks = routed.offsets.back() / kRows;
  return routed;
}

TaskShape shape_of(const ListCase& which, int routed_mblocks) {
  TaskShape shape{};
  shape.num_experts = static_cast<int>(which.counts.size());
  shape.shared_mblocks = which.shared_mblocks;
  shape.routed_mblocks = routed_mblocks;
  shape.minibatch_mblocks = which.minibatch_mblocks;
  shape.ring_mblocks = which.ring_mblocks > 0 ? which.ring_mblocks : 1 << 20;
  for (int kind = 0; kind < kNumTaskKinds; ++kind) shape.n_blocks[kind] = which.n_blocks[kind];
  return shape;
}

// Decodes the tickets in `tickets` (increasing) as one CTA does: the routed row blocks become
// known once a ticket reaches past the shared gate/up tasks.
std::map<int, Task> decode_all(const ListCase& which, const Routed& routed,
                               const std::vector<int>& tickets) {
  TaskShape shape = shape_of(which, 0);
  TaskScheduler scheduler(shape, routed.offsets.data(), which.counts.data(), 1000);
  bool routed_known = false;
  std::map<int, Task> tasks;
  for (int ticket : tickets) {
    if (!routed_known && ticket >= scheduler.shared_gate_up_tasks()) {
      scheduler.set_routed_mblocks(routed.mblocks);
      routed_known = true;
    }
    Task task;
    if (!scheduler.decode(ticket, task)) break;
    tasks[ticket] = task;
  }
  return tasks;
}

class TaskListTest : public ::testing::TestWithParam<ListCase> {};

TEST_P(TaskListTest, EveryTileOnceInDependencyOrder) {
  const ListCase& which = GetParam();
  const Routed routed = lay_out(which.counts);
  const int shared_tasks =
      which.shared_mblocks * (which.n_blocks[static_cast<int>(TaskKind::kSharedGateUp)] +
                              which.n_blocks[static_cast<int>(TaskKind::kSharedDown)]);
  const int routed_tasks = routed.mblocks * (which.n_blocks[static_cast<int>(TaskKind::kGateUp)] +
                                             which.n_blocks[static_cast<int>(TaskKind::kDown)]);
  const int total = shared_tasks + routed_tasks;
  std::vector<int> every(total + 5);  // a few past the end: they must decode to nothing
  for (int ticket = 0; ticket < static_cast<int>(every.size()); ++ticket) every[ticket] = ticket;
  const std::map<int, Task> tasks = decode_all(which, routed, every);
  ASSERT_EQ(static_cast<int>(tasks.size()), total) << "tasks decoded";

  // Each (kind, row block, column block) once, with the tile fields of its expert.
  std::map<std::tuple<int, int, int>, int> ticket_of;
  for (const auto& [ticket, task] : tasks) {
    const int kind = static_cast<int>(task.kind);
    ASSERT_LT(task.tile.n_block, which.n_blocks[kind]) << "ticket " << ticket;
    ASSERT_GE(task.tile.n_block, 0) << "ticket " << ticket;
    const auto key = std::make_tuple(kind, task.mblock, task.tile.n_block);
    ASSERT_EQ(ticket_of.count(key), 0u) << "tile decoded twice, ticket " << ticket;
    ticket_of[key] = ticket;
    if (is_shared(task.kind)) {
      EXPECT_EQ(task.tile.mblock, task.mblock);
      EXPECT_LT(task.mblock, which.shared_mblocks);
    } else {
      const int expert = task.tile.group;
      ASSERT_GE(expert, 0);
      ASSERT_LT(expert, static_cast<int>(which.counts.size()));
      EXPECT_EQ(task.tile.row_count, which.counts[expert]);
      EXPECT_EQ(task.mblock, routed.offsets[expert] / kRows + task.tile.mblock);
      EXPECT_LT(task.tile.mblock * kRows, which.counts[expert]) << "a block without rows";
      // The tile's rows in the ring: block mblock sits at ring block mblock mod ring_mblocks.
      const int ring = shape_of(which, routed.mblocks).ring_mblocks;
      EXPECT_EQ(task.tile.row_begin + task.tile.mblock * kRows, task.mblock % ring * kRows)
          << "ticket " << ticket;
      EXPECT_EQ(task.frees_ring_block,
                task.kind == TaskKind::kDown && task.mblock + ring < routed.mblocks)
          << "ticket " << ticket;
    }
  }
  // Every task after what it waits for: down after the block's gate/up tiles, shared down after
  // the block's shared gate/up tiles.
  for (const auto& [ticket, task] : tasks) {
    TaskKind needs;
    if (task.kind == TaskKind::kDown) {
      needs = TaskKind::kGateUp;
    } else if (task.kind == TaskKind::kSharedDown) {
      needs = TaskKind::kSharedGateUp;
    } else {
      continue;
    }
    for (int n = 0; n < which.n_blocks[static_cast<int>(needs)]; ++n) {
      const auto found = ticket_of.find({static_cast<int>(needs), task.mblock, n});
      ASSERT_NE(found, ticket_of.end()) << "missing input tile of ticket " << ticket;
      EXPECT_LT(found->second, ticket) << "ticket " << ticket << " comes before its input";
    }
  }
  // Ring rounds: a routed gate/up tile of block g overwrites the hidden rows of block
  // g - ring_mblocks, whose down tiles must come first; the dispatch of block g overwrites the
  // rows of block g - ring_mblocks, whose gate/up tiles must come before block g's.
  if (which.ring_mblocks > 0) {
    int wraps = 0;
    for (const auto& [ticket, task] : tasks) {
      if (task.kind != TaskKind::kGateUp || task.mblock < which.ring_mblocks) continue;
      ++wraps;
      const int previous = task.mblock - which.ring_mblocks;
      for (int n = 0; n < which.n_blocks[static_cast<int>(TaskKind::kDown)]; ++n) {
        EXPECT_LT(ticket_of.at({static_cast<int>(TaskKind::kDown), previous, n}), ticket)
            << "gate/up ticket " << ticket << " overwrites hidden rows not yet read";
      }
      for (int n = 0; n < which.n_blocks[static_cast<int>(TaskKind::kGateUp)]; ++n) {
        EXPECT_LT(ticket_of.at({static_cast<int>(TaskKind::kGateUp), previous, n}), ticket)
            << "gate/up ticket " << ticket << " needs rows dispatched over unread ones";
      }
    }
    EXPECT_GT(wraps, 0) << "the case never reuses a ring slot";
  }

  // Carried tails: the tile of an expert's last block is carried when ceil(rows / 8) blocks before
  // it, in its minibatch, can each take 8 of its rows (at most kMaxTailCarriers, one with ring
  // rounds): block last - 1 - j takes rows 8 j .. 8 j + 7 (same kind and column block); no other
  // tile carries or is carried.
  const bool one_round = routed.mblocks <= shape_of(which, routed.mblocks).ring_mblocks;
  int carried = 0, several = 0;
  for (const auto& [ticket, task] : tasks) {
    if (is_shared(task.kind)) {
      EXPECT_FALSE(task.carried);
      EXPECT_EQ(task.tail_rows, 0);
      continue;
    }
    const int count = which.counts[task.tile.group];
    const int blocks = (count + kRows - 1) / kRows;
    const int tail = count - (blocks - 1) * kRows;
    const int carriers = (tail + kCarriedTailRows - 1) / kCarriedTailRows;
    const int last = routed.offsets[task.tile.group] / kRows + blocks - 1;
    const bool carries_ok =
        blocks >= 2 && carriers <= blocks - 1 && carriers <= (one_round ? kMaxTailCarriers : 1) &&
        last / which.minibatch_mblocks == (last - carriers) / which.minibatch_mblocks;
    const int j = last - 1 - task.mblock;
    const bool carrier = carries_ok && j >= 0 && j < carriers;
    EXPECT_EQ(task.carried, carries_ok && task.mblock == last) << "ticket " << ticket;
    EXPECT_EQ(task.tail_rows, carrier ? std::min(kCarriedTailRows, tail - j * kCarriedTailRows) : 0)
        << "ticket " << ticket;
    if (carrier) {
      EXPECT_EQ(task.tail_carrier, j) << "ticket " << ticket;
      EXPECT_EQ(task.tail_carriers, carriers) << "ticket " << ticket;
    }
    if (task.carried) {
      ++carried;
      several += carriers > 1 ? 1 : 0;
      for (int k = 0; k < carriers; ++k) {
        const auto found =
            ticket_of.find({static_cast<int>(task.kind), task.mblock - 1 - k, task.tile.n_block});
        ASSERT_NE(found, ticket_of.end()) << "ticket " << ticket;
        EXPECT_EQ(tasks.at(found->second).tail_carrier, k) << "ticket " << ticket;
      }
    }
  }
  if (std::string(which.name).rfind("carried", 0) == 0) {
    EXPECT_GT(carried, 0) << "no tail was carried";
    if (which.ring_mblocks == 0) EXPECT_GT(several, 0) << "no tail had several carriers";
  }

  // A CTA that saw only some tickets (random increasing subsets) decodes each the same way.
  std::mt19937 random(7);
  for (int trial = 0; trial < 20; ++trial) {
    std::vector<int> some;
    for (int ticket = 0; ticket < total; ++ticket) {
      if (random() % 5 == 0) some.push_back(ticket);
    }
    for (const auto& [ticket, task] : decode_all(which, routed, some)) {
      const Task& expected = tasks.at(ticket);
      ASSERT_EQ(task.kind, expected.kind) << "ticket " << ticket;
      ASSERT_EQ(task.mblock, expected.mblock) << "ticket " << ticket;
      ASSERT_EQ(task.tile.n_block, expected.tile.n_block) << "ticket " << ticket;
      ASSERT_EQ(task.tile.group, expected.tile.group) << "ticket " << ticket;
      ASSERT_EQ(task.carried, expected.carried) << "ticket " << ticket;
      ASSERT_EQ(task.tail_rows, expected.tail_rows) << "ticket " << ticket;
      ASSERT_EQ(task.tail_carrier, expected.tail_carrier) << "ticket " << ticket;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, TaskListTest,
    ::testing::Values(
        // Experts of 0, 1, 127, 128, 129 and 1000 rows; a shared expert; several minibatches.
        ListCase{"mixed", {0, 1, 127, 128, 129, 1000, 0, 300}, 3, 2, {2, 3, 4, 2}, 0},
        // One row block per minibatch: the longest list.
        ListCase{"one_block_minibatch", {200, 0, 513, 64}, 2, 1, {1, 2, 3, 1}, 0},
        // One minibatch holds everything; no shared expert.
        ListCase{"one_minibatch", {700, 900, 5}, 0, 1000, {1, 16, 1, 28}, 0},
        // A hot expert spans several minibatches, and minibatches cut experts.
        ListCase{"hot_expert", {3000, 10, 10, 10}, 1, 4, {2, 2, 2, 2}, 0},
        // No routed rows at all (every token went elsewhere); only the shared expert.
        ListCase{"no_routed_rows", {0, 0, 0}, 4, 2, {3, 2, 2, 3}, 0},
        // Ring rounds: the smallest ring (two minibatches of one block), experts across rounds.
        ListCase{"ring_two_blocks", {200, 0, 513, 64, 129}, 1, 1, {1, 2, 3, 1}, 2},
        // A hot expert through a ring of three minibatches of two blocks.
        ListCase{"ring_hot_expert", {3000, 10, 0, 300}, 2, 2, {2, 3, 2, 2}, 6},
        // Tails carried by one block (136, 264, 130, 392), two (400) or three (532); not without
        // blocks enough before (8, 140, 280), not past three carriers (160). With ring rounds by
        // one at most, and not across two minibatches (264 in minibatches of 4 blocks).
        ListCase{"carried_tails",
                 {136, 264, 130, 8, 392, 140, 280, 532, 160, 400},
                 1,
                 8,
                 {2, 3, 2, 2},
                 0},
        ListCase{"carried_tails_ring", {136, 264, 130, 8, 392, 140, 136}, 1, 4, {2, 3, 2, 2}, 8}),
    [](const auto& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace mok::megakernel
