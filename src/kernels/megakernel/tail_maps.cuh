// Tail maps: the A operand of a routed tile whose row block ends inside its expert's rows (the
// expert's last block, padded up to 128 rows) is loaded through a copy of the A map whose rows end
// where the expert's rows do, so the TMA fills the padding rows with zeros.
//
// The padding rows of expert_x and of the hidden rows are never written: the MMAs multiply them
// (up to 63 rows of a block, wgmma's M being 64) but no valid output depends on them, since an
// output row depends on its own input row only. Left as they are they hold rows of earlier calls,
// and multiplying those draws more power than multiplying zeros: with the routing of the call
// before in them, the forward ran 1 % slower at deepseek-v3 EP1 on H200 (docs/perf-notes/layer.md
// v32). Writing zeros there instead cost as much as it saved; a tail map costs one 128-byte copy
// per expert and call.
//
// The schedule CTAs write the maps (2 E_l of them: gate/up and down, expert by expert) once they
// know the rows, before the schedule is published; a producer that has acquired the schedule
// fences the map before its first load through it (ptx/tma.cuh).
#pragma once

#include <cuda.h>

#include <cstdint>

#include "kernels/gemm/gemm_types.cuh"
#include "kernels/megakernel/forward_params.cuh"
#include "kernels/megakernel/task_list.cuh"
#include "kernels/ptx/tma.cuh"
#include "kernels/schedule/tile_scheduler.cuh"

namespace mok::megakernel {

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900

// The tail map of a task, or null when its block is full of its expert's rows (or a shared task,
// or the maps are off).
__device__ inline const CUtensorMap* tail_map(const FusedForwardParams& params, const Task& task) {
  if (params.tail_maps == nullptr || is_shared(task.kind)) return nullptr;
  const int rows = task.tile.row_count - task.tile.m_block * gemm::TileConfig::BLOCK_M;
  if (rows >= gemm::TileConfig::BLOCK_M) return nullptr;
  const int experts = static_cast<int>(params.view.layout.experts_per_rank());
  return params.tail_maps + (task.kind == TaskKind::kDown ? experts : 0) + task.tile.group;
}

// The schedule CTAs, all threads, after place_rows: offsets (shared memory, E_l + 1) and the
// counts are this call's. Each expert whose rows end inside a block gets its two maps: the ring's
// A maps (expert_x, routed_hidden) with rows cut at the end of that block's rows.
__device__ inline void write_tail_maps(const FusedForwardMaps& maps,
                                       const FusedForwardParams& params, int cta, int num_ctas,
                                       const int32_t* offsets) {
  if (params.tail_maps == nullptr) return;
  constexpr int kRows = gemm::TileConfig::BLOCK_M;
  const int experts = static_cast<int>(params.view.layout.experts_per_rank());
  const int32_t* counts = params.view.counts();
  for (int index = cta * static_cast<int>(blockDim.x) + static_cast<int>(threadIdx.x);
       index < 2 * experts; index += num_ctas * static_cast<int>(blockDim.x)) {
    const int expert = index % experts;
    const int count = counts[expert];
    if (count % kRows == 0) continue;  // no tail (or no rows)
    const int first_row = offsets[expert] + count / kRows * kRows;  // the tail block's
    const int ring_row = first_row - ring_round_base(first_row / kRows, params.ring_mblocks);
    const TaskKind kind = index < experts ? TaskKind::kGateUp : TaskKind::kDown;
    const uint4* from = reinterpret_cast<const uint4*>(&maps.a[static_cast<int>(kind)]);
    CUtensorMap* map = params.tail_maps + index;
    uint4* to = reinterpret_cast<uint4*>(map);
#pragma unroll
    for (int part = 0; part < static_cast<int>(sizeof(CUtensorMap) / sizeof(uint4)); ++part) {
      to[part] = from[part];
    }
    ptx::tensormap_replace_global_dim<1>(map, static_cast<uint32_t>(ring_row + count % kRows));
  }
  ptx::fence_tensormap_release();
}

#endif  // __CUDA_ARCH__ >= 900

}  // namespace mok::megakernel
