// The expert-parallel communication steps of one layer, each enqueued on the caller's stream with
// no host synchronisation (so the whole sequence can be captured in a CUDA graph). Every rank
// enqueues the same sequence; the kernels meet through flags in the windows.
//
//   x written to ws.x()  (or stage_tokens; fp8: stage_fp8_tokens)
//   schedule            all-gather topk_idx, order each local expert's rows
//   dispatch            pull the rows into ws.expert_x() (fp8: dispatch_fp8, into E4M3 rows)
//   ... the experts compute ws.expert_y() from ws.expert_x() ...
//   combine_push        push every output row to its owner's slot
//   combine_reduce      the owner's fixed-order weighted sum, + shared output, -> y (bf16)
//
// Device faults end the kernels and are reported by ws.check(stream).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/comm/row_copy.cuh"
#include "mok/bf16.hpp"
#include "runtime/workspace.hpp"

namespace mok {

struct CopyConfig {
  int num_ctas = 0;                               // CTAs (one per SM) that move rows; 0 = every SM
  int threads_per_cta = comm::kVectorMaxThreads;  // a multiple of 32: one warp per row
};

// x (T, H) bf16 on this device -> ws.x().
void stage_tokens(CommWorkspace& ws, const bf16* x, int64_t num_tokens, cudaStream_t stream);

// The fp8 forward's tokens: x (T, H) quantized 1 x 128 along H (data (T, H) E4M3, scales (T, H /
// 128) fp32) -> ws.x() as packed rows, H bytes then H / 128 scales in each row's 2H (dispatch_fp8).
void stage_fp8_tokens(CommWorkspace& ws, const uint8_t* data, const float* scales,
                      int64_t num_tokens, cudaStream_t stream);

// The first step of a call (bumps the epoch, zeroes the counters); `schedule` begins with it, the
// fused forward (fused_forward.hpp) needs it before its launch.
void begin_call(CommWorkspace& ws, cudaStream_t stream);

// topk_idx (T, k) int32 on this device; T = num_tokens <= tokens_max. ws.x() must hold the tokens.
// topk_w (T, k) fp32, in a workspace with the backward's regions: staged into ws.topk_w() by the
// same kernel (or null: not staged).
void schedule(CommWorkspace& ws, const int32_t* topk_idx, int64_t num_tokens, cudaStream_t stream,
              const float* topk_w = nullptr);

// Pulls every routed row into ws.expert_x() (tensor kX: the tokens' x from the owners' windows)
// or, in a workspace with the backward's regions, into ws.expert_dy() (kDy: their dy).
void dispatch(CommWorkspace& ws, const CopyConfig& config, cudaStream_t stream,
              comm::DispatchTensor tensor = comm::DispatchTensor::kX);

// One rank alone (after schedule): ws.expert_x() from x (T, H) and ws.expert_dy() from dy, either
// null to leave its rows alone (not both), by token: each token's row is read once and written to
// each of its slots' rows (dispatch reads it once per slot). The same rows as dispatch's.
void dispatch_tokens(CommWorkspace& ws, const CopyConfig& config, cudaStream_t stream,
                     const bf16* x, const bf16* dy = nullptr);
// The same for one tensor (x or dy: `tokens`, (T, H)) and a window of the expert rows alone:
// window (device int32 {first, count}) names rows first .. first + count - 1, which go into rows
// (count, H) from its first row (a chunk of the experts: LayerBackwardOptions::chunk_rows).
void dispatch_tokens_window(CommWorkspace& ws, const CopyConfig& config, cudaStream_t stream,
                            const bf16* tokens, bf16* rows, const int32_t* window);

// After stage_fp8_tokens on every rank: pulls every routed row's packed fp8 row into data (rows,
// H) E4M3 and scales (rows, H / 128) fp32 (the rows' order as dispatch's; ws.expert_x() unused).
void dispatch_fp8(CommWorkspace& ws, const CopyConfig& config, cudaStream_t stream, uint8_t* data,
                  float* scales);

// One rank alone: launches nothing (no row to move, no peer to signal).
void combine_push(CommWorkspace& ws, const CopyConfig& config, cudaStream_t stream);

// topk_w (T, k) fp32; shared_output (T, H) fp32 or null; y (T, H) bf16. T as in `schedule`.
// d_topk_w (T, k) fp32 or null: the backward's router-weight gradients, collected from the window
// in the same launch. One rank alone waits for no push: the stream orders what wrote its rows.
void combine_reduce(CommWorkspace& ws, const float* topk_w, const float* shared_output, bf16* y,
                    int64_t num_tokens, cudaStream_t stream, float* d_topk_w = nullptr);

// Every rank waits here until every rank has arrived (device-side, with the timeout).
void rank_barrier(CommWorkspace& ws, cudaStream_t stream);

}  // namespace mok
