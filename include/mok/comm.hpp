// Expert-parallel communication on its own, for C++ users: the dispatch and combine of one MoE
// layer over NVLink (NCCL's device API), with the caller computing the experts in between. One
// CommEngine per rank; the ranks are GPUs of this process. Every step is enqueued on the caller's
// CUDA stream with no host synchronisation (the sequence can be captured in a CUDA graph); every
// rank enqueues the same sequence, and the kernels meet through flags in the ranks' windows.
//
//   auto engines = mok::CommEngine::create_local({0, 1}, shape, tokens_max);  // EP = 2
//   mok::CommEngine::for_each_rank(2, [&](int rank) {                      // a host thread each
//     mok::CommEngine& engine = *engines[rank];
//     cudaSetDevice(engine.device());
//     engine.stage_tokens(x, T, stream);              // (or write x straight into engine.x())
//     engine.schedule(topk_idx, T, stream);           // all-gather topk_idx, order the rows
//     engine.dispatch({}, stream);                    // pull the rows into expert_x()
//     (the experts compute expert_y() from expert_x(), rows as expert_offsets() lays them out)
//     engine.combine_push({}, stream);                // each output row to its owner's slot
//     engine.combine_reduce(topk_w, y, T, stream);    // y_t = sum_j w_tj * row_tj, j in order
//     engine.check(stream);                           // syncs; throws on a device fault
//   });
//
// Rows: expert e of this rank (local index e, global rank * E_l + e) holds rows
// [expert_offsets()[e], expert_offsets()[e + 1]) of expert_x() and expert_y(), its tokens in
// global token order (rank, token, slot), padded to a multiple of block_m rows; row_source()[row]
// = (src_rank * tokens_max + t) * k + j, or -1 for a padding row. y is bitwise the same for any
// EP degree and any copy configuration.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "mok/bf16.hpp"
#include "mok/shape.hpp"

namespace mok {

// The copy kernels (dispatch, combine push) are built for at most this many threads per CTA.
inline constexpr int kVectorMaxThreads = 1024;

// How dispatch and combine push move rows: one warp per row, dealt round-robin to the grid's warps.
struct CommCopyConfig {
  int num_ctas = 0;                         // CTAs (one per SM) that move rows; 0 = every SM
  int threads_per_cta = kVectorMaxThreads;  // a multiple of 32 in [32, kVectorMaxThreads]
};

struct CommEngineOptions {
  int64_t block_m = kRowBlock;  // each expert's rows start at a multiple of this (a tile height)
  int64_t timeout_ms = 10000;   // every device-side wait gives up after this long
};

class CommEngine {
 public:
  // One engine per device, rank i on devices[i], EP = devices.size(), for calls of at most
  // `tokens_max` tokens per rank; the windows are made collectively, one host thread per device.
  // One device: EP = 1, no NCCL. Throws mok::Error naming a bad argument (devices, tokens_max, the
  // shape at this EP degree, an option) or a missing NCCL.
  // The ranks' device memory is freed together (collectively) when the last of them is destroyed.
  static std::vector<std::unique_ptr<CommEngine>> create_local(
      const std::vector<int>& devices, const LayerShape& shape, int64_t tokens_max,
      const CommEngineOptions& options = {});

  // Runs fn(rank) for rank = 0..num_ranks-1 on one host thread each, joins them, and rethrows the
  // first exception (in rank order): how one process drives its engines, whose steps wait for one
  // another on the devices.
  static void for_each_rank(int num_ranks, const std::function<void(int rank)>& fn);

  ~CommEngine();
  CommEngine(const CommEngine&) = delete;
  CommEngine& operator=(const CommEngine&) = delete;

  int rank() const;
  int num_ranks() const;
  int device() const;
  const LayerShape& shape() const;
  int64_t tokens_max() const;
  // Rows of expert_x() and expert_y(): every row a call can route to this rank, padding included.
  int64_t rows_capacity() const;

  // Device buffers, on device(). x (tokens_max, H) bf16: this rank's tokens, in its window (where
  // peers read them); expert_x, expert_y (rows_capacity, H) bf16: the dispatched rows and the
  // experts' output rows; expert_counts (E_l), expert_offsets (E_l + 1), row_source
  // (rows_capacity) int32: what `schedule` made.
  bf16* x() const;
  bf16* expert_x() const;
  bf16* expert_y() const;
  const int32_t* expert_counts() const;
  const int32_t* expert_offsets() const;
  const int32_t* row_source() const;

  // The steps, in call order; the current CUDA device must be device(), `stream` a cudaStream_t
  // of it (null: the legacy default stream). num_tokens T <= tokens_max, the same in every step
  // of a call; ranks may differ in T.
  // x (T, H) bf16 on this device -> x().
  void stage_tokens(const bf16* x, int64_t num_tokens, void* stream);
  // topk_idx (T, k) int32 (-1 = unused slot; the ids of a row distinct). x() must hold the tokens.
  void schedule(const int32_t* topk_idx, int64_t num_tokens, void* stream);
  // Every rank waits here until every rank has arrived (on the device, with the timeout).
  void rank_barrier(void* stream);
  void dispatch(const CommCopyConfig& copy, void* stream);
  // One rank alone (EP 1) launches nothing here: its rows stay where the experts wrote them, and
  // its combine_reduce, on the same stream after them, waits for no peer.
  void combine_push(const CommCopyConfig& copy, void* stream);
  // topk_w (T, k) fp32; y (T, H) bf16, 16-byte aligned; shared_output (T, H) fp32 added last
  // (a shared expert's output), or null.
  void combine_reduce(const float* topk_w, bf16* y, int64_t num_tokens, void* stream,
                      const float* shared_output = nullptr);

  // Waits for `stream`; throws mok::Error naming rank, phase and cause of a device fault (an
  // expert id out of range or repeated in a row, a peer that never arrived).
  void check(void* stream) const;
  // After a fault: clears the error record, flags and epochs. Collective: call it on every rank
  // once every rank's stream is idle, and launch nothing until every rank has returned.
  void reset_after_error();

 private:
  struct Impl;
  explicit CommEngine(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace mok
