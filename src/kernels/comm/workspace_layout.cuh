// The expert-parallel workspace: one symmetric NCCL window per rank (same offsets on every rank)
// and one local buffer. Both are laid out by `WorkspaceLayout`, which the host uses to size the
// allocations and the kernels use to find their pointers: the offset arithmetic lives here only.
//
// Window (symmetric, peers read and write it over NVLink):
//   flags         (kNumFlagKinds, kMaxRanks) uint32   written by source rank s into slot [kind][s]
//   token_counts  (kMaxRanks) int32                   tokens each source rank holds this call
//   topk          (R, T_max, k) int32                 all-gathered expert ids, source rank major
//   x             (T_max, H) bf16                     this rank's tokens, pulled by expert ranks;
//                                                     none in one rank's backward (below)
//   slots         (slot_rows, H) bf16                 combine slots (t, j), pushed by expert
//                                                     ranks; none (0 rows) at EP 1 with expert_y,
//                                                     where the reduce reads every row there, nor
//                                                     in one rank's backward, whose slot (t, j)
//                                                     is expert_dy row t · k + j
//   dy            (T_max, H) bf16                     backward: this rank's dy, pulled like x;
//                                                     none in one rank's backward
//   topk_w        (T_max, k) fp32                     backward: this rank's router weights, read
//                                                     by the expert ranks for d_h = w · g
//   d_topk_w      (T_max, k) fp32                     backward: <g, h> of each (t, j), stored by
//                                                     the expert rank (one writer per element)
// Local (this GPU only):
//   state         DeviceState                         epochs, arrival counters, error record
//   counts        (E_l) int32                         rows of each local expert
//   offsets       (E_l + 1) int32                     first row of each local expert, tile padded
//   row_source    (rows_capacity) int32               (src_rank * T_max + t) * k + j, -1 = padding
//   slice_rows    (R, slices, E_l) int32              the fused schedule's rows of each local
//                                                     expert per slice of kScheduleSlice ids of a
//                                                     source rank, then (scanned) the rows before
//                                                     the slice (token_schedule.cuh)
//   local_row     (T_max, k) int32                    for this rank's own (t, j) served by a local
//                                                     expert: its row in expert_y (the combine
//                                                     reads it there instead of copying it)
//   task_counters (kNumTaskCounters, mblocks_capacity) readiness counts of the fused forward's row
//                 uint32                              blocks (kernels/megakernel), zeroed per call;
//                                                     none in a backward's workspace
//   expert_x      (expert_rows, H) bf16               dispatched rows, expert-major, global order;
//                                                     row g sits at g mod expert_rows (the fused
//                                                     forward's ring; the unfused path needs
//                                                     expert_rows = rows_capacity)
//   expert_y      (expert_y_rows, H) bf16             expert outputs, same rows; 0 rows when the
//                                                     down GEMM writes every row to its owner's
//                                                     slot (the fused forward), own rows included
//   expert_dy     (rows_capacity, H) bf16             backward: dispatched dy rows, as expert_x
//
// One rank's backward (rows_in_expert_dy) keeps three row sets in expert_dy's bytes, one after
// the other: dy's expert rows, then the dx rows (the combine slots, its first T_max · k rows),
// then x's expert rows (expert_x is expert_dy); the caller orders its steps so (LayerBackward).
// It reads x and dy from the caller's tensors, so its window has no x or dy rows.
#pragma once

#include <cstdint>

#include "kernels/comm/error_record.cuh"

namespace mok::comm {

inline constexpr int kMaxRanks = 8;  // one NVLink (LSA) domain
inline constexpr int64_t kRegionAlignment = 4096;
// Ids per slice of the schedule: one warp's share, 32 ids a step. A step takes ~1 µs whatever
// the slice (docs/perf-notes/backward.md v34), so shorter slices spread the steps over more warps,
// while the scan's rounds (32 slices each, one warp an expert) grow with the slices.
inline constexpr int64_t kScheduleSlice = 256;
// The fused forward's readiness counters, one per block of block_m rows (kernels/megakernel).
enum class TaskCounter : int {
  kRowsArrived = 0,        // expert rows the dispatch has copied into the block
  kHiddenReady = 1,        // routed gate/up tiles of the block stored
  kSharedHiddenReady = 2,  // shared gate/up tiles stored (block of this rank's tokens)
  kDownDone = 3,           // routed down tiles that have read the block (ring rounds only)
};
inline constexpr int kNumTaskCounters = 4;

// Which readiness flag: each has one uint32 slot per source rank in every rank's window.
enum class FlagKind : int {
  kGather = 0,   // source pushed its topk_idx and token count here; its x is ready to be pulled
  kCombine = 1,  // source pushed every expert output row it owes this rank
  kBarrier = 2,  // source reached a standalone barrier
};
inline constexpr int kNumFlagKinds = 3;

// The fused forward hands out its task tickets in grants of this many consecutive ones, one grant
// at a time to each L2 partition's CTAs (kernels/megakernel/tickets.cuh).
inline constexpr uint32_t kTicketGrant = 32;
inline constexpr int kMaxL2Partitions = 2;
// The schedule's passes (token_schedule.cuh: gather, count, scan, place), each stamped at its end.
inline constexpr int kSchedulePasses = 4;

// Per-GPU state in the local buffer. `epoch` numbers the calls: flags are compared against it and
// never reset, so a replayed CUDA graph reuses them safely.
struct DeviceState {
  uint32_t epoch;               // bumped once per call by the first kernel of the call
  uint32_t barrier_epoch;       // bumped by each standalone barrier
  uint32_t combine_arrivals;    // CTAs of the combine push that finished this call
  uint32_t down_tiles_done;     // routed down tiles of the fused forward stored this call
  uint32_t next_task;           // the fused forward's next task ticket
  uint32_t schedule_epoch;      // the fused forward's schedule is complete for this epoch
  uint32_t barrier_count;       // CTAs in the current grid barrier (comm::grid_barrier)
  uint32_t barrier_generation;  // barriers passed (never reset)
  // The fused forward's ticket grant of each L2 partition: (first ticket + 1) << 32 | tickets
  // taken from it (kernels/megakernel/tickets.cuh).
  alignas(8) unsigned long long task_pool[kMaxL2Partitions];
  // The GPU's global timer (ns) when this call's first kernel began (begin_call): when a peer
  // times out waiting for this rank, tells whether the rank's call itself started late.
  unsigned long long call_began_ns;
  // The global timer (ns) when the latest schedule began (make_schedule, CTA 0) and when each of
  // its passes ended (the grid barrier after it): where the schedule's time goes, for the notes.
  unsigned long long schedule_ns[kSchedulePasses + 1];
  ErrorRecord error;
};

MOK_COMM_HOST_DEVICE int64_t align_up(int64_t value, int64_t alignment) {
  return (value + alignment - 1) / alignment * alignment;
}

struct WorkspaceLayout {
  int32_t num_ranks = 0;      // R
  int64_t tokens_max = 0;     // T_max, tokens per rank capacity
  int64_t hidden = 0;         // H
  int64_t top_k = 0;          // k
  int64_t num_experts = 0;    // E, global
  int64_t block_m = 0;        // tile height: each expert's rows start at a multiple of it
  int64_t expert_rows = 0;    // rows of expert_x (rows_capacity unless a ring is smaller)
  int64_t expert_y_rows = 0;  // rows of expert_y: rows_capacity or 0
  int64_t slot_rows = 0;      // rows of the combine slots: T_max * k, or 0 (see slots above)
  bool backward = false;      // the backward's regions (dy, topk_w, d_topk_w, expert_dy)
  // One rank's backward: dy's rows, the slots (the dx rows) and x's rows in expert_dy's bytes in
  // turn (see above); no slots, x or dy in the window.
  bool rows_in_expert_dy = false;

  int64_t flags_offset = 0, token_counts_offset = 0, topk_offset = 0, x_offset = 0;
  int64_t slots_offset = 0, dy_offset = 0, topk_w_offset = 0, d_topk_w_offset = 0;
  int64_t window_bytes = 0;
  int64_t state_offset = 0, counts_offset = 0, offsets_offset = 0, row_source_offset = 0;
  int64_t local_row_offset = 0, task_counters_offset = 0, slice_rows_offset = 0;
  int64_t expert_x_offset = 0, expert_y_offset = 0, expert_dy_offset = 0, local_bytes = 0;

  MOK_COMM_HOST_DEVICE int64_t experts_per_rank() const { return num_experts / num_ranks; }
  // Slices of kScheduleSlice ids that a source rank's (T, k) ids are cut into, at most.
  MOK_COMM_HOST_DEVICE int64_t slices_per_source() const {
    return (tokens_max * top_k + kScheduleSlice - 1) / kScheduleSlice;
  }
  MOK_COMM_HOST_DEVICE int64_t row_bytes() const { return hidden * 2; }
  // Every token sends at most k rows to a rank; each expert wastes at most block_m - 1 rows.
  MOK_COMM_HOST_DEVICE int64_t rows_capacity() const {
    return num_ranks * tokens_max * top_k + experts_per_rank() * (block_m - 1);
  }
  // Row blocks of block_m rows: of the expert rows, and (for the task counters) of the tokens.
  MOK_COMM_HOST_DEVICE int64_t mblocks_capacity() const {
    const int64_t rows = rows_capacity() > tokens_max ? rows_capacity() : tokens_max;
    return (rows + block_m - 1) / block_m;
  }
  // Task counters of each kind: one per row block for the fused forward; none in a backward's
  // workspace, which no fused forward runs on (and whose rows may be unpadded: block_m = 1).
  MOK_COMM_HOST_DEVICE int64_t task_counter_blocks() const {
    return backward ? 0 : mblocks_capacity();
  }

  // Rows of this rank's own tokens stay in expert_y for the reduce to read in place; without
  // expert_y they are in the own window's slots like everyone else's.
  MOK_COMM_HOST_DEVICE bool has_expert_y() const { return expert_y_rows > 0; }

  // Sized from shapes only. The caller validates the arguments (see Workspace).
  // expert_rows: rows of expert_x, 0 = rows_capacity(); with_expert_y: allocate expert_y;
  // with_backward: the backward's regions too; rows_in_expert_dy (one rank's backward, no
  // expert_y; rows_capacity >= T_max · k): the slots and expert_x in expert_dy (see above).
  MOK_COMM_HOST_DEVICE static WorkspaceLayout make(
      int32_t num_ranks, int64_t tokens_max, int64_t hidden, int64_t top_k, int64_t num_experts,
      int64_t block_m, int64_t expert_rows = 0, bool with_expert_y = true,
      bool with_backward = false, bool rows_in_expert_dy = false) {
    WorkspaceLayout layout;
    layout.num_ranks = num_ranks;
    layout.tokens_max = tokens_max;
    layout.hidden = hidden;
    layout.top_k = top_k;
    layout.num_experts = num_experts;
    layout.block_m = block_m;
    layout.expert_rows = expert_rows > 0 && expert_rows < layout.rows_capacity()
                             ? expert_rows
                             : layout.rows_capacity();
    layout.expert_y_rows = with_expert_y ? layout.rows_capacity() : 0;
    // With expert_y and one rank every row is this rank's own: the reduce reads it in expert_y.
    layout.rows_in_expert_dy = rows_in_expert_dy;
    layout.slot_rows =
        (num_ranks == 1 && with_expert_y) || rows_in_expert_dy ? 0 : tokens_max * top_k;
    layout.backward = with_backward;
    const int64_t backward_rows = with_backward ? 1 : 0;
    const int64_t window_rows = rows_in_expert_dy ? 0 : tokens_max;  // x and dy

    int64_t cursor = 0;
    auto take = [&cursor](int64_t bytes) {
      const int64_t offset = cursor;
      cursor = align_up(cursor + bytes, kRegionAlignment);
      return offset;
    };
    layout.flags_offset = take(int64_t{kNumFlagKinds} * kMaxRanks * 4);
    layout.token_counts_offset = take(int64_t{kMaxRanks} * 4);
    layout.topk_offset = take(int64_t{num_ranks} * tokens_max * top_k * 4);
    layout.x_offset = take(window_rows * layout.row_bytes());
    layout.slots_offset = take(layout.slot_rows * layout.row_bytes());
    layout.dy_offset = take(backward_rows * window_rows * layout.row_bytes());
    layout.topk_w_offset = take(backward_rows * tokens_max * top_k * 4);
    layout.d_topk_w_offset = take(backward_rows * tokens_max * top_k * 4);
    layout.window_bytes = cursor;

    cursor = 0;
    layout.state_offset = take(sizeof(DeviceState));
    layout.counts_offset = take(layout.experts_per_rank() * 4);
    layout.offsets_offset = take((layout.experts_per_rank() + 1) * 4);
    layout.row_source_offset = take(layout.rows_capacity() * 4);
    layout.slice_rows_offset =
        take(int64_t{num_ranks} * layout.slices_per_source() * layout.experts_per_rank() * 4);
    layout.local_row_offset = take(tokens_max * top_k * 4);
    layout.task_counters_offset = take(kNumTaskCounters * layout.task_counter_blocks() * 4);
    layout.expert_x_offset = take(rows_in_expert_dy ? 0 : layout.expert_rows * layout.row_bytes());
    layout.expert_y_offset = take(layout.expert_y_rows * layout.row_bytes());
    layout.expert_dy_offset = take(backward_rows * layout.rows_capacity() * layout.row_bytes());
    if (rows_in_expert_dy) layout.expert_x_offset = layout.expert_dy_offset;
    layout.local_bytes = cursor;
    return layout;
  }
};

// What a kernel needs to reach the workspace: the layout, this rank's place, every rank's window
// as this GPU addresses it (read once at creation through ncclGetPeerPointer), the local buffer.
struct WorkspaceView {
  WorkspaceLayout layout;
  int32_t rank = 0;
  uint64_t timeout_ns = 0;  // every device wait gives up after this long
  char* windows[kMaxRanks] = {};
  char* local = nullptr;

  // ---- window of rank `owner` -------------------------------------------------------------
  MOK_COMM_HOST_DEVICE uint32_t* flag(int owner, FlagKind kind, int source) const {
    return reinterpret_cast<uint32_t*>(windows[owner] + layout.flags_offset) +
           static_cast<int>(kind) * kMaxRanks + source;
  }
  MOK_COMM_HOST_DEVICE int32_t* token_counts(int owner) const {
    return reinterpret_cast<int32_t*>(windows[owner] + layout.token_counts_offset);
  }
  // (T_max, k) ids of source rank `source`, as held in rank `owner`'s window.
  MOK_COMM_HOST_DEVICE int32_t* topk(int owner, int source) const {
    return reinterpret_cast<int32_t*>(windows[owner] + layout.topk_offset) +
           static_cast<int64_t>(source) * layout.tokens_max * layout.top_k;
  }
  MOK_COMM_HOST_DEVICE char* x_row(int owner, int64_t token) const {
    return windows[owner] + layout.x_offset + token * layout.row_bytes();
  }
  MOK_COMM_HOST_DEVICE char* slot_row(int owner, int64_t token, int64_t slot) const {
    if (layout.rows_in_expert_dy) return expert_dy_row(token * layout.top_k + slot);
    return windows[owner] + layout.slots_offset +
           (token * layout.top_k + slot) * layout.row_bytes();
  }
  // Backward regions (layout.backward).
  MOK_COMM_HOST_DEVICE char* dy_row(int owner, int64_t token) const {
    return windows[owner] + layout.dy_offset + token * layout.row_bytes();
  }
  MOK_COMM_HOST_DEVICE float* topk_w(int owner) const {  // (T_max, k)
    return reinterpret_cast<float*>(windows[owner] + layout.topk_w_offset);
  }
  MOK_COMM_HOST_DEVICE float* d_topk_w(int owner) const {  // (T_max, k)
    return reinterpret_cast<float*>(windows[owner] + layout.d_topk_w_offset);
  }

  // ---- local ----------------------------------------------------------------------------------
  MOK_COMM_HOST_DEVICE DeviceState* state() const {
    return reinterpret_cast<DeviceState*>(local + layout.state_offset);
  }
  MOK_COMM_HOST_DEVICE int32_t* counts() const {
    return reinterpret_cast<int32_t*>(local + layout.counts_offset);
  }
  // (R, slices_per_source, E_l): see the layout above.
  MOK_COMM_HOST_DEVICE int32_t* slice_rows() const {
    return reinterpret_cast<int32_t*>(local + layout.slice_rows_offset);
  }
  MOK_COMM_HOST_DEVICE int32_t* offsets() const {
    return reinterpret_cast<int32_t*>(local + layout.offsets_offset);
  }
  MOK_COMM_HOST_DEVICE int32_t* row_source() const {
    return reinterpret_cast<int32_t*>(local + layout.row_source_offset);
  }
  MOK_COMM_HOST_DEVICE int32_t* local_row() const {  // (T_max, k)
    return reinterpret_cast<int32_t*>(local + layout.local_row_offset);
  }
  // The counters of one kind, one per row block; kind 0's are the start of all of them.
  MOK_COMM_HOST_DEVICE uint32_t* task_counters(TaskCounter kind) const {
    return reinterpret_cast<uint32_t*>(local + layout.task_counters_offset) +
           static_cast<int>(kind) * layout.task_counter_blocks();
  }
  MOK_COMM_HOST_DEVICE char* expert_x_row(int64_t row) const {
    return local + layout.expert_x_offset + row * layout.row_bytes();
  }
  MOK_COMM_HOST_DEVICE char* expert_y_row(int64_t row) const {
    return local + layout.expert_y_offset + row * layout.row_bytes();
  }
  MOK_COMM_HOST_DEVICE char* expert_dy_row(int64_t row) const {  // layout.backward
    return local + layout.expert_dy_offset + row * layout.row_bytes();
  }
};

// Which token rows a dispatch moves: the forward's x into expert_x, or the backward's dy into
// expert_dy (the same rows, in the same order).
enum class DispatchTensor : int { kX = 0, kDy = 1 };

// A row's source packed into one int: which rank's token, and which of its top-k slots.
struct RowSource {
  int32_t rank, token, slot;
};
MOK_COMM_HOST_DEVICE int32_t pack_row_source(const WorkspaceLayout& layout, int rank, int64_t token,
                                             int64_t slot) {
  return static_cast<int32_t>((rank * layout.tokens_max + token) * layout.top_k + slot);
}
// In unsigned 32-bit arithmetic: packed lies in [0, 2^31) (the workspace checks R * T_max * k
// fits), so are its quotients, and a 64-bit division is a long subroutine on the GPU, which the
// down tiles' epilogue ran once per output row.
MOK_COMM_HOST_DEVICE RowSource unpack_row_source(const WorkspaceLayout& layout, int32_t packed) {
  const uint32_t bits = static_cast<uint32_t>(packed);
  const uint32_t top_k = static_cast<uint32_t>(layout.top_k);
  const uint32_t tokens = static_cast<uint32_t>(layout.tokens_max);
  const uint32_t global_token = bits / top_k;
  return {static_cast<int32_t>(global_token / tokens), static_cast<int32_t>(global_token % tokens),
          static_cast<int32_t>(bits - global_token * top_k)};
}

}  // namespace mok::comm
