// The fused forward's compute tasks: every (128-row block, 256-column block) tile of the four
// expert GEMMs of one layer, in one dependency order that every compute CTA derives on its own.
//
//   kSharedGateUp  x (T, H) -> shared_hidden (T, I_s), SwiGLU        needs nothing
//   kGateUp        expert_x -> routed_hidden (rows, I), SwiGLU       needs the block's rows
//   dispatched kSharedDown    shared_hidden -> shared_output (T, H) fp32        needs the block's
//   shared gate/up kDown          routed_hidden -> expert_y (rows, H) bf16          needs the
//   block's gate/up tiles
//
// Rows come in blocks of 128 (BLOCK_M): each local expert's rows start at a block boundary, so
// block g covers rows [128 g, 128 g + 128) of the call's expert rows and belongs to one expert.
// The routed blocks are cut into minibatches of `minibatch_mblocks` blocks (minibatch k is blocks
// [k B, (k + 1) B); an expert may span two); the list of segments is
//   SG | SD | R0 | R1 D0 | R2 D1 | ... | R(n-1) D(n-2) | D(n-1)
// (S = shared, R = routed gate/up, D = routed down of one minibatch): the shared expert's tiles
// run while the schedule is made and the first minibatch's rows arrive, and each minibatch's down
// tiles wait one minibatch behind its gate/up tiles, so their inputs are normally complete when
// they start. Within a segment the tiles go expert by expert, and within an expert column block
// outer, row block inner, as in the standalone grouped GEMM: the CTAs running side by side share
// the expert's weight tiles and its rows through L2. (The shared gate/up tiles go row block
// outer, column block inner: see decode.)
//
// Ring rounds: expert_x and the routed hidden rows hold `ring_mblocks` blocks (a multiple of B, at
// least 2 B), and block g lives at ring block g mod ring_mblocks. Before the dispatch writes block
// g, the gate/up tiles of block g - ring_mblocks must have read it; before a gate/up tile of block
// g writes its hidden rows, the down tiles of block g - ring_mblocks must have read theirs. That
// block lies at least two minibatches back, so its down tiles come before R(k) in the list.
//
// Carried tails (kCarriedTailRows): an expert's last block of a few rows keeps its tickets, but
// the tiles of the blocks before it, in the same minibatch, compute it and raise its counters;
// its own tiles are skipped (Task::carried, Task::tail_rows). They wait for their own and the
// tail's inputs, which the same minibatch brings, so the order argument below holds.
//
// CTAs take tasks by ticket (one atomic counter), so each CTA's tasks come in increasing order,
// and a CTA runs its tasks in the order it took them. Every task depends only on tasks earlier in
// the list (or on the dispatch, which depends only on gate/up tasks of earlier blocks, hence
// earlier tickets), so the earliest unfinished task can always run: the order cannot deadlock
// while all CTAs are resident and at least one of them does not dispatch.
#pragma once

#include "kernels/comm/workspace_layout.cuh"
#include "kernels/gemm/gemm_types.cuh"
#include "kernels/gemm/tile_scheduler.cuh"

namespace mok::megakernel {

enum class TaskKind : int { kSharedGateUp = 0, kGateUp = 1, kSharedDown = 2, kDown = 3 };
inline constexpr int kNumTaskKinds = 4;

__host__ __device__ constexpr bool is_shared(TaskKind kind) {
  return kind == TaskKind::kSharedGateUp || kind == TaskKind::kSharedDown;
}

// The sizes that fix the task list of one call.
struct TaskShape {
  int num_experts;        // local experts
  int shared_mblocks;     // ceil(T / 128) with a shared expert, else 0
  int routed_mblocks;     // rows of the local experts (tile padded) / 128
  int minibatch_mblocks;  // row blocks per minibatch, >= 1
  int ring_mblocks;  // row blocks of the ring (expert_x, hidden): a multiple of minibatch_mblocks
                     // >= 2 minibatch_mblocks, or at least routed_mblocks (one round)
  int n_blocks[kNumTaskKinds];  // 256-column blocks of each GEMM's output (before SwiGLU halving)

  __host__ __device__ int num_minibatches() const {
    return (routed_mblocks + minibatch_mblocks - 1) / minibatch_mblocks;
  }
};

// An expert whose last row block holds only a few rows (its tail) has them computed by the tiles
// of the blocks before it ("carried"): each of those tiles also multiplies kCarriedTailRows of
// the tail's rows by the weight tile already in its stages, with wgmma's N over them
// (gemm/carried_tail.cuh), instead of a tile of its own that streams the whole weight tile for a
// few rows and multiplies 64 (docs/perf-notes/layer.md). Carrier j (the block j + 1 before
// the tail) takes the tail's rows 8 j .. 8 j + 7; a tail needs ceil(rows / 8) carriers, at most
// kMaxTailCarriers, all in the tail's minibatch. With several carriers the tail's counters reach
// their counts only once every carrier has raised them; the dispatch's ring-slot wait does not
// know that, so a ring of several rounds takes one carrier at most.
inline constexpr int kCarriedTailRows = 8;
inline constexpr int kMaxTailCarriers = 3;

struct Task {
  TaskKind kind;
  int mblock;  // row block: of the call's expert rows, or of this rank's tokens (shared)
  // Routed down tile whose block's ring slot a later round reuses: it reports that it has read it.
  bool frees_ring_block;
  // Routed: the tile of a carried tail block (nothing to do: the tiles of the blocks before it
  // compute it); or, tail_rows > 0, a carrier: the tail's rows 8 j .. 8 j + tail_rows - 1 with
  // j = tail_carrier (the tail is block mblock + 1 + j), one of tail_carriers.
  bool carried;
  int tail_rows;
  int tail_carrier;
  int tail_carriers;
  gemm::GroupedTile tile;  // what the GEMM mainloop and epilogue take; row_begin is the expert's
                           // first row in the ring buffers' round of this block

  // A carrier's tail block is this many blocks after its own.
  __host__ __device__ int tail_offset() const { return 1 + tail_carrier; }
};

// The first row of block `mblock`'s round, in the call's expert rows (ring slot 0 of the round).
__host__ __device__ inline int ring_round_base(int mblock, int ring_mblocks) {
  return mblock / ring_mblocks * ring_mblocks * gemm::TileConfig::BLOCK_M;
}

// Decodes task tickets; the tickets one scheduler sees must not decrease (its cursors only move
// forward).
class TaskScheduler {
 public:
  // Until set_routed_mblocks, only the first segment (the shared gate/up tasks) is known.
  // offsets (E_l + 1) and counts (E_l) of the local experts' rows: the schedule's.
  __host__ __device__ TaskScheduler(const TaskShape& shape, const int32_t* offsets,
                                    const int32_t* counts, int num_tokens)
      : shape_(shape), offsets_(offsets), counts_(counts), num_tokens_(num_tokens) {
    num_segments_ = 1;
    load_segment(0);
  }

  __host__ __device__ int shared_gate_up_tasks() const {
    return shape_.shared_mblocks * shape_.n_blocks[static_cast<int>(TaskKind::kSharedGateUp)];
  }

  // The routed row blocks of the call, from the schedule: every segment is known from here on.
  __host__ __device__ void set_routed_mblocks(int routed_mblocks) {
    shape_.routed_mblocks = routed_mblocks;
    const int minibatches = shape_.num_minibatches();
    num_segments_ = minibatches == 0 ? 3 : 2 * minibatches + 2;
  }

  // Fills `task` for `ticket`; false when the ticket is past the last task.
  __host__ __device__ bool decode(int ticket, Task& task) {
    task_ = ticket;
    while (segment_ < num_segments_ && task_ >= segment_first_ + segment_size_) {
      segment_first_ += segment_size_;
      load_segment(segment_ + 1);
    }
    if (segment_ >= num_segments_) return false;
    task.kind = kind_;
    task.frees_ring_block = false;
    task.carried = false;
    task.tail_rows = 0;
    task.tail_carrier = 0;
    task.tail_carriers = 0;
    if (is_shared(kind_)) {
      const int local = task_ - segment_first_;
      int mblock, nblock;
      if (kind_ == TaskKind::kSharedGateUp) {
        // Column block inner: the CTAs side by side read the same x rows, so x (T rows of the
        // full hidden width, more than L2 holds for T = 8192) is read from memory about once,
        // where row block inner read it once per few column blocks; the shared weights (the
        // smaller part) are read once per group of row blocks instead.
        const int n_blocks = shape_.n_blocks[static_cast<int>(TaskKind::kSharedGateUp)];
        mblock = local / n_blocks;
        nblock = local % n_blocks;
      } else {
        mblock = local % shape_.shared_mblocks;
        nblock = local / shape_.shared_mblocks;
      }
      task.mblock = mblock;
      task.tile = {0, mblock, nblock, 0, num_tokens_};
    } else {
      // The segment's experts in order; the task lies inside the segment, so inside one of them.
      while (task_ >= expert_first_task_ + expert_tiles_) {
        expert_first_task_ += expert_tiles_;
        load_expert(expert_ + 1);
      }
      const int local = task_ - expert_first_task_;
      const int row_begin = offsets_[expert_];
      const int mblock = expert_skip_mblocks_ + local % expert_mblocks_;
      task.mblock = row_begin / gemm::TileConfig::BLOCK_M + mblock;
      task.frees_ring_block =
          kind_ == TaskKind::kDown && task.mblock + shape_.ring_mblocks < shape_.routed_mblocks;
      task.tile = {expert_, mblock, local / expert_mblocks_,
                   row_begin - ring_round_base(task.mblock, shape_.ring_mblocks), counts_[expert_]};
      const int carriers = tail_carriers(row_begin, counts_[expert_]);
      if (carriers > 0) {
        const int last = (counts_[expert_] - 1) / gemm::TileConfig::BLOCK_M;
        const int carrier = last - 1 - mblock;  // j: the block j + 1 before the tail
        task.carried = mblock == last;
        if (carrier >= 0 && carrier < carriers) {
          const int tail = counts_[expert_] - last * gemm::TileConfig::BLOCK_M;
          const int rows = tail - carrier * kCarriedTailRows;
          task.tail_rows = rows < kCarriedTailRows ? rows : kCarriedTailRows;
          task.tail_carrier = carrier;
          task.tail_carriers = carriers;
        }
      }
    }
    return true;
  }

  // How many tiles of an expert's blocks carry its tail (kCarriedTailRows each), 0 for none: the
  // blocks right before the tail, all in the tail's minibatch (the carriers wait for the tail's
  // rows, which the same minibatch brings), and one of them at most unless the ring holds every
  // row in one round.
  __host__ __device__ int tail_carriers(int row_begin, int count) const {
    constexpr int kRows = gemm::TileConfig::BLOCK_M;
    const int blocks = (count + kRows - 1) / kRows;
    const int tail = count - (blocks - 1) * kRows;
    const int carriers = (tail + kCarriedTailRows - 1) / kCarriedTailRows;
    const bool one_round = shape_.routed_mblocks <= shape_.ring_mblocks;
    if (blocks < 2 || carriers > blocks - 1 || carriers > (one_round ? kMaxTailCarriers : 1)) {
      return 0;
    }
    const int tail_block = row_begin / kRows + blocks - 1;
    const bool one_minibatch =
        tail_block / shape_.minibatch_mblocks == (tail_block - carriers) / shape_.minibatch_mblocks;
    return one_minibatch ? carriers : 0;
  }

 private:
  // Segment `index` of the list in the header comment: its kind and row blocks.
  __host__ __device__ void load_segment(int index) {
    segment_ = index;
    if (index >= num_segments_) return;
    int minibatch = 0;
    if (index == 0) {
      kind_ = TaskKind::kSharedGateUp;
    } else if (index == 1) {
      kind_ = TaskKind::kSharedDown;
    } else if (index == 2) {
      kind_ = TaskKind::kGateUp;
    } else {
      const int j = index - 3;
      const int minibatches = shape_.num_minibatches();
      if (j % 2 == 1) {
        kind_ = TaskKind::kDown;
        minibatch = j / 2;
      } else if (j / 2 + 1 < minibatches) {
        kind_ = TaskKind::kGateUp;
        minibatch = j / 2 + 1;
      } else {
        kind_ = TaskKind::kDown;
        minibatch = minibatches - 1;
      }
    }
    const int n_blocks = shape_.n_blocks[static_cast<int>(kind_)];
    if (is_shared(kind_)) {
      segment_size_ = shape_.shared_mblocks * n_blocks;
      return;
    }
    block_begin_ = minibatch * shape_.minibatch_mblocks;
    block_end_ = block_begin_ + shape_.minibatch_mblocks;
    if (block_end_ > shape_.routed_mblocks) block_end_ = shape_.routed_mblocks;
    segment_size_ = (block_end_ - block_begin_) * n_blocks;
    expert_first_task_ = segment_first_;
    load_expert(expert_holding(block_begin_));
  }

  // The local expert whose rows hold row block `mblock` (< routed_mblocks): the last one that
  // starts at or before it (experts without rows start where the next one does).
  __host__ __device__ int expert_holding(int mblock) const {
    const int row = mblock * gemm::TileConfig::BLOCK_M;
    int low = 0, high = shape_.num_experts;  // the first expert starting after `row`
    while (low < high) {
      const int middle = (low + high) / 2;
      if (offsets_[middle] <= row) {
        low = middle + 1;
      } else {
        high = middle;
      }
    }
    return low - 1;
  }

  // The expert's row blocks inside the segment's [block_begin_, block_end_).
  __host__ __device__ void load_expert(int expert) {
    expert_ = expert;
    if (expert >= shape_.num_experts) return;  // past the segment: never decoded
    constexpr int kRows = gemm::TileConfig::BLOCK_M;
    const int first = offsets_[expert] / kRows, end = offsets_[expert + 1] / kRows;
    const int clipped_first = first > block_begin_ ? first : block_begin_;
    const int clipped_end = end < block_end_ ? end : block_end_;
    expert_skip_mblocks_ = clipped_first - first;
    expert_mblocks_ = clipped_end > clipped_first ? clipped_end - clipped_first : 0;
    expert_tiles_ = expert_mblocks_ * shape_.n_blocks[static_cast<int>(kind_)];
  }

  TaskShape shape_;
  const int32_t* offsets_;
  const int32_t* counts_;
  int num_tokens_;
  int task_ = 0;
  int num_segments_ = 0;
  int segment_ = 0;
  int segment_first_ = 0;  // first task index of the segment
  int segment_size_ = 0;
  TaskKind kind_ = TaskKind::kSharedGateUp;
  int block_begin_ = 0, block_end_ = 0;  // routed segments: the minibatch's row blocks
  // Routed segments: the expert the cursor is at, its first task, its row blocks in the segment
  // (after the first expert_skip_mblocks_ of its own) and tiles.
  int expert_ = 0;
  int expert_first_task_ = 0;
  int expert_skip_mblocks_ = 0;
  int expert_mblocks_ = 0;
  int expert_tiles_ = 0;
};

}  // namespace mok::megakernel
