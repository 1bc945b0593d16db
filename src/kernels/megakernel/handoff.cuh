// The fused forward's hand-off from the producer warp, which takes and decodes the tasks, to the
// warps that run them: the two consumer warpgroups and the producer's three helper warps
// (row_gather.cuh).
#pragma once

#include <cstdint>

#include "kernels/gemm/gemm_types.cuh"
#include "kernels/megakernel/task_list.cuh"

namespace mok::megakernel {

// kTaskSlots slots in order, each with a full barrier (the producer wrote it) and an empty one
// (every reading warp is done with it). A slot whose task.mblock is kNoTask tells the readers to
// stop.
inline constexpr int kTaskSlots = 4;
inline constexpr int kNoTask = -1;
inline constexpr int kTaskReaderWarps = gemm::TileConfig::kNumConsumerWarpgroups * 4 + 3;

struct TaskRing {
  Task task[kTaskSlots];
  uint64_t full[kTaskSlots];
  uint64_t empty[kTaskSlots];
  // A gathered gate/up task's row starts (row_gather.cuh), read by the producer warps until they
  // release the slot.
  const char* gather_rows[kTaskSlots][gemm::TileConfig::BLOCK_M];
};

}  // namespace mok::megakernel
