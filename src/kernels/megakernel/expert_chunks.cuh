// The chunks' tables of a chunked backward (expert_chunk_plan.hpp), written on the device after
// the schedule, every chunk's at once, one CTA a chunk. Every routed sum is one expert's (a wgrad
// over its rows) or one row's (a dgrad, the SwiGLU backward), so running the routed chain a chunk
// at a time splits none of them: the bits are those of every expert at once, whatever the chunks.
#pragma once

#include <cstdint>

#include "kernels/comm/flags.cuh"
#include "kernels/comm/workspace_layout.cuh"
#include "kernels/megakernel/expert_chunk_plan.hpp"

namespace mok::megakernel {

inline constexpr int kExpertChunkThreads = 512;

// Chunk `index` of the greedy packing into at most `capacity` rows, by one CTA; an index past the
// last chunk gets an empty one (every expert outside), as does a call whose schedule raised an
// error. staged: E_l ints of shared memory, where the counts are read once by every thread, so
// that the packing's serial walk over the experts reads shared memory, not global (a walk over
// global loads took 12-32 us a chunk at 128 experts).
__device__ inline void write_expert_chunk(const comm::WorkspaceView& view, const ExpertChunk& chunk,
                                          int32_t index, int32_t capacity, int32_t* staged) {
  __shared__ int32_t range[2];  // the chunk's experts: [first, end)
  const int32_t experts = static_cast<int32_t>(view.layout.experts_per_rank());
  const int32_t* counts = view.counts();
  const int32_t* offsets = view.offsets();
  for (int32_t expert = threadIdx.x; expert < experts; expert += blockDim.x) {
    staged[expert] = counts[expert];
  }
  const bool error = comm::cta_sees_error(view);  // (every thread: a CTA barrier)
  if (threadIdx.x == 0) {
    const ExpertRange chunk_experts = error ? ExpertRange{experts, experts}
                                            : expert_chunk_range(staged, experts, index, capacity);
    range[0] = chunk_experts.first;
    range[1] = chunk_experts.end;
    chunk.range[0] = chunk_experts.first;
    chunk.range[1] = chunk_experts.end;
  }
  __syncthreads();
  const int32_t first = range[0], end = range[1];
  // (offsets are unpadded in a backward's workspace: an expert's rows end where the next begin)
  const int32_t first_row = offsets[first];
  const int32_t rows = offsets[end] - first_row;
  if (threadIdx.x == 0) {
    chunk.window[0] = first_row;
    chunk.window[1] = rows;
  }
  for (int32_t expert = threadIdx.x; expert <= experts; expert += blockDim.x) {
    const bool inside = expert >= first && expert < end;
    if (expert < experts) chunk.counts[expert] = inside ? staged[expert] : -1;
    chunk.offsets[expert] = expert < first ? 0 : expert >= end ? rows : offsets[expert] - first_row;
  }
  const int32_t* row_source = view.row_source() + first_row;
  for (int32_t row = threadIdx.x; row < rows; row += blockDim.x) {
    chunk.row_source[row] = row_source[row];
  }
}

}  // namespace mok::megakernel
