// The expert-parallel workspace of one rank: the symmetric NCCL window (ncclMemAlloc +
// ncclCommWindowRegister) that peers reach over NVLink, an ncclDevComm with LSA barriers, and a
// local buffer for the schedule and the expert rows. Everything is sized from shapes alone
// (comm::WorkspaceLayout); nothing about a call's routing is needed up front.
//
// Creation and destruction are collective: every rank of the communicator does them at the same
// time (one host thread per GPU in a single process, see for_each_rank).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "kernels/comm/workspace_layout.cuh"
#include "mok/bf16.hpp"
#include "mok/shape.hpp"
#include "runtime/comm.hpp"

namespace mok {

struct WorkspaceOptions {
  int64_t block_m = kRowBlock;  // tile height: each expert's rows start at a multiple of it
  int64_t timeout_ms = 10000;   // every device wait gives up after this long
  // Rows of expert_x: 0 = every row a call can route here (rows_capacity); fewer only for the
  // fused forward, which goes through them in ring rounds.
  int64_t expert_rows = 0;
  // expert_y holds the routed down GEMM's rows for the standalone combine push; the fused forward
  // writes them straight into the owners' slots and needs none.
  bool expert_y = true;
  // The backward's regions: dy, topk_w and d_topk_w in the window, expert_dy (LayerBackward).
  bool backward = false;
  // One rank's backward without expert_y: dy's expert rows, the combine slots (expert_dy's first
  // T_max · k rows) and x's expert rows (expert_x) share expert_dy's bytes, each written only
  // once nothing reads the one before (LayerBackward at EP 1); no x or dy rows in the window.
  bool rows_in_expert_dy = false;
};

// The layout a CommWorkspace of these arguments has (its constructor's), for sizing without one.
comm::WorkspaceLayout workspace_layout(const LayerShape& shape, int num_ranks, int64_t tokens_max,
                                       const WorkspaceOptions& options);

class CommWorkspace {
 public:
  CommWorkspace(const Communicator& comm, const LayerShape& shape, int64_t tokens_max,
                const WorkspaceOptions& options = {});
  ~CommWorkspace();
  CommWorkspace(const CommWorkspace&) = delete;
  CommWorkspace& operator=(const CommWorkspace&) = delete;

  const comm::WorkspaceView& view() const { return view_; }
  const comm::WorkspaceLayout& layout() const { return view_.layout; }
  const LayerShape& shape() const { return shape_; }
  int rank() const { return comm_.rank(); }
  int num_ranks() const { return comm_.num_ranks(); }
  int device() const { return comm_.device(); }
  // SMs of this rank's share of its GPU: all of them, or (ranks emulated on one GPU,
  // Communicator::emulate) 1 / ranks_on_device of them, for the kernels that wait on peers.
  int num_sms() const { return num_sms_; }
  // The GPU's global timer (ns) when the last call's first kernel began on this rank; reads the
  // device (a synchronous copy: for reports after a failure, not while peers' kernels wait).
  uint64_t call_began_ns() const;
  // What each pass of the latest schedule took (µs: gather, count, scan, place; comm::DeviceState's
  // stamps); a synchronous read, for reports.
  std::vector<double> schedule_pass_us() const;
  bool shares_device() const { return comm_.ranks_on_device() > 1; }

  // (T_max, H): this rank's tokens, in its window (none: rows_in_expert_dy). Write x here before
  // `schedule`.
  // NOTE: host-facing pointers use the allocation's own address; kernels reach the same memory
  // through NCCL's mapping of every rank's window (view().windows), which may differ.
  bf16* x() const { return reinterpret_cast<bf16*>(window_base() + view_.layout.x_offset); }
  // (T_max, k, H): the combine slots, in this rank's window (or, rows_in_expert_dy, expert_dy).
  bf16* slots() const {
    if (view_.layout.rows_in_expert_dy) return expert_dy();
    return reinterpret_cast<bf16*>(window_base() + view_.layout.slots_offset);
  }
  // (expert_rows, H) and (expert_y_rows, H): dispatched rows and expert outputs, local (expert_x
  // is expert_dy with rows_in_expert_dy).
  bf16* expert_x() const { return reinterpret_cast<bf16*>(view_.expert_x_row(0)); }
  bf16* expert_y() const { return reinterpret_cast<bf16*>(view_.expert_y_row(0)); }
  // Backward regions (WorkspaceOptions::backward): (T_max, H) dy (none: rows_in_expert_dy) and
  // (T_max, k) topk_w of this rank's tokens, written before `schedule`; (T_max, k) d_topk_w, stored
  // by the expert ranks; (rows_capacity, H) expert_dy, the dispatched dy rows.
  bf16* dy() const { return reinterpret_cast<bf16*>(window_base() + view_.layout.dy_offset); }
  float* topk_w() const {
    return reinterpret_cast<float*>(window_base() + view_.layout.topk_w_offset);
  }
  float* d_topk_w() const {
    return reinterpret_cast<float*>(window_base() + view_.layout.d_topk_w_offset);
  }
  bf16* expert_dy() const { return reinterpret_cast<bf16*>(view_.expert_dy_row(0)); }
  const int32_t* expert_counts() const { return view_.counts(); }    // (E_l), device
  const int32_t* expert_offsets() const { return view_.offsets(); }  // (E_l + 1), device
  const int32_t* row_source() const { return view_.row_source(); }   // (rows_capacity), device

  // Waits for `stream`, then throws mok::Error naming the rank, the phase and the cause if a
  // device-side fault was recorded (an expert id out of range, a peer that never arrived).
  void check(cudaStream_t stream) const;

  // After a fault: clears the error record, the flags and the epochs. Collective: call it on every
  // rank once every rank's stream is idle, and launch nothing until every rank has returned.
  void reset_after_error();

 private:
  char* window_base() const { return static_cast<char*>(window_memory_); }

  Communicator comm_;
  LayerShape shape_;
  comm::WorkspaceView view_;
  int num_sms_ = 0;
  void* window_memory_ = nullptr;  // ncclMemAlloc (R > 1) or cudaMalloc (R = 1)
  void* local_memory_ = nullptr;
  void* window_handle_ = nullptr;  // ncclWindow_t
  void* dev_comm_ = nullptr;       // ncclDevComm*, host copy
};

}  // namespace mok
