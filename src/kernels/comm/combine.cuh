// Combine, in two steps:
//   push    each expert output row of a peer's token goes to the owner's slot [t * k + j] (one
//           writer per slot, no atomics); the last CTA signals the combine flag to every rank.
//           Rows of this rank's own tokens stay where the expert wrote them (expert_y): copying
//           them into the local slots would only spend the SMs' time. (A workspace without
//           expert_y, the fused forward's, has every row in the slots.)
//           One rank alone has no row to move and no peer to tell: it launches no push.
//   reduce  the owner waits for every rank's combine flag (one rank alone: for none, the stream
//           orders the kernels that wrote its rows before it), then for each token sums
//           w[t, j] * slot[t, j] in fp32 in j order (skipping -1 slots), adds the fp32 shared
//           expert output (0 when there is none), and rounds to bf16 once. Each element has one
//           fixed order of operations, the CPU reference's, so the result is bitwise reproducible
//           and independent of the number of ranks.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/comm/flags.cuh"
#include "kernels/comm/row_copy.cuh"
#include "kernels/comm/workspace_layout.cuh"
#include "mok/detail/numerics.hpp"

namespace mok::comm {

inline constexpr int kReduceThreads = 256;
inline constexpr int kReduceVector = 8;     // bf16 per 16-byte access
inline constexpr int kReduceSlotBatch = 8;  // top-k slots whose rows one thread loads at once

struct CombineRows {
  WorkspaceView view;
  __device__ RowCopy operator()(int64_t row) const {
    const int32_t packed = view.row_source()[row];
    if (packed < 0) return {nullptr, nullptr};
    const RowSource source = unpack_row_source(view.layout, packed);
    if (source.rank == view.rank) return {nullptr, nullptr};  // read in place by the reduce
    return {view.expert_y_row(row), view.slot_row(source.rank, source.token, source.slot)};
  }
};

__device__ inline void combine_push(const WorkspaceView& view) {
  if (cta_sees_error(view)) return;
  DeviceState* state = view.state();
  const uint32_t epoch = state->epoch;
  // (One rank alone never launches it: combine_push's launcher.)
  const int64_t num_rows = view.offsets()[view.layout.experts_per_rank()];
  const CombineRows rows{view};
  copy_rows_vector</*kSourceReadOnly=*/true>(num_rows, view.layout.row_bytes(), rows);
  if (last_block_arrived(&state->combine_arrivals)) {
    signal_all_ranks(view, FlagKind::kCombine, epoch);
  }
}

// The backward's d_topk_w (T, k) fp32 of this rank's tokens from its window, 0 for unused slots
// (the expert ranks stored them before their push); every thread of the grid takes its share.
__device__ inline void collect_d_topk_w(const WorkspaceView& view, float* d_topk_w,
                                        int32_t num_tokens) {
  const int32_t* ids = view.topk(view.rank, view.rank);
  const float* gathered = view.d_topk_w(view.rank);
  const int64_t count = static_cast<int64_t>(num_tokens) * view.layout.top_k;
  for (int64_t index = blockIdx.x * blockDim.x + threadIdx.x; index < count;
       index += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    d_topk_w[index] = ids[index] < 0 ? 0.0f : gathered[index];
  }
}

// topk_w (T, k) fp32; shared_output (T, H) fp32 or null; y (T, H) bf16; d_topk_w (T, k) fp32 or
// null: the backward's, collected beside the sum.
__device__ inline void combine_reduce(const WorkspaceView& view, const float* topk_w,
                                      const float* shared_output, __nv_bfloat16* y, float* d_topk_w,
                                      int32_t num_tokens) {
  if (cta_sees_error(view)) return;
  DeviceState* state = view.state();
  const WorkspaceLayout& layout = view.layout;
  if (layout.num_ranks > 1 &&
      !wait_flags_all_ranks(view, FlagKind::kCombine, state->epoch, Phase::kReduce)) {
    return;
  }
  if (d_topk_w != nullptr) collect_d_topk_w(view, d_topk_w, num_tokens);
  const int32_t* ids = view.topk(view.rank, view.rank);  // (T, k), this rank's own, gathered
  // NOTE: the item's token and column in 32 bits (the launcher checks the count fits): a 64-bit
  // division is a long subroutine, once per item.
  const uint32_t vectors_per_row = static_cast<uint32_t>(layout.hidden / kReduceVector);
  const uint32_t num_items = static_cast<uint32_t>(num_tokens) * vectors_per_row;
  for (uint32_t item = blockIdx.x * blockDim.x + threadIdx.x; item < num_items;
       item += gridDim.x * blockDim.x) {
    const int64_t token = item / vectors_per_row;
    const int64_t column = static_cast<int64_t>(item % vectors_per_row) * kReduceVector;
    float sum[kReduceVector];
#pragma unroll
    for (int lane = 0; lane < kReduceVector; ++lane) sum[lane] = 0.0f;
    // Slots in batches: every row load of a batch is issued before the first add, so each thread
    // keeps kReduceSlotBatch loads in flight (one at a time left the reduce latency-bound); the
    // adds then run in slot order, as before. What a row's place depends on (its expert, its row
    // in expert_y) and its weight are loaded side by side first, so that a row load waits for one
    // round trip, not two.
    const bool in_place = layout.has_expert_y();
    for (int64_t batch = 0; batch < layout.top_k; batch += kReduceSlotBatch) {
      int4 packed[kReduceSlotBatch];
      float weight[kReduceSlotBatch];
      int32_t expert[kReduceSlotBatch], local_row[kReduceSlotBatch];
#pragma unroll
      for (int index = 0; index < kReduceSlotBatch; ++index) {
        const int64_t slot = batch + index;
        const bool real = slot < layout.top_k;
        expert[index] = real ? ids[token * layout.top_k + slot] : -1;
        weight[index] = real ? topk_w[token * layout.top_k + slot] : 0.0f;
        local_row[index] = real && in_place ? view.local_row()[token * layout.top_k + slot] : 0;
      }
      uint32_t used = 0;  // bit i: slot batch + i holds an expert
#pragma unroll
      for (int index = 0; index < kReduceSlotBatch; ++index) {
        packed[index] = make_int4(0, 0, 0, 0);
        if (expert[index] < 0) continue;  // an unused slot (or past k): skipped in the sum below
        used |= 1u << index;
        // Ids were range-checked by the schedule: expert / E_l is a rank. Own rows are read in
        // place from expert_y when the workspace has one (else they were stored in the slots).
        const char* row = in_place && expert[index] / layout.experts_per_rank() == view.rank
                              ? view.expert_y_row(local_row[index])
                              : view.slot_row(view.rank, token, batch + index);
        packed[index] = *reinterpret_cast<const int4*>(row + column * 2);
      }
#pragma unroll
      for (int index = 0; index < kReduceSlotBatch; ++index) {
        if ((used >> index & 1u) == 0) continue;
        const __nv_bfloat16* values = reinterpret_cast<const __nv_bfloat16*>(&packed[index]);
#pragma unroll
        for (int lane = 0; lane < kReduceVector; ++lane) {
          sum[lane] = numerics::add_rn(
              sum[lane], numerics::mul_rn(weight[index], __bfloat162float(values[lane])));
        }
      }
    }
    int4 packed_out;
    __nv_bfloat16* out = reinterpret_cast<__nv_bfloat16*>(&packed_out);
#pragma unroll
    for (int lane = 0; lane < kReduceVector; ++lane) {
      const float shared =
          shared_output != nullptr ? shared_output[token * layout.hidden + column + lane] : 0.0f;
      out[lane] = __float2bfloat16_rn(numerics::add_rn(sum[lane], shared));
    }
    *reinterpret_cast<int4*>(y + token * layout.hidden + column) = packed_out;
  }
}

// A standalone barrier across the ranks (one thread); used to line up timed regions and tests.
__device__ inline void rank_barrier(const WorkspaceView& view) {
  DeviceState* state = view.state();
  if (has_error(&state->error)) return;
  const uint32_t epoch = ++state->barrier_epoch;
  signal_all_ranks(view, FlagKind::kBarrier, epoch);
  for (int source = 0; source < view.layout.num_ranks; ++source) {
    if (!wait_flag(view, FlagKind::kBarrier, source, epoch, Phase::kBarrier)) return;
  }
}

}  // namespace mok::comm
