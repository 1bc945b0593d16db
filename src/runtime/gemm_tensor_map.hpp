// TMA tensor maps for the grouped GEMM operands (host side). Every map is bf16 with the 128-byte
// swizzle and zero fill out of bounds; boxes are 64 elements (128 B) wide along the contiguous
// dimension, the width one swizzle row holds.
#pragma once

#include <cuda.h>

#include <cstdint>

namespace mok::gemm {

// A [rows, columns] row-major bf16 matrix, box (box_rows, 64 columns).
CUtensorMap make_tensor_map_2d(const void* base, uint64_t rows, uint64_t columns, uint32_t box_rows,
                               const char* argument);

// A [batch, rows, columns] row-major bf16 tensor, box (1, box_rows, box_columns).
CUtensorMap make_tensor_map_3d(const void* base, uint64_t batch, uint64_t rows, uint64_t columns,
                               uint32_t box_rows, uint32_t box_columns, const char* argument);

// A wgrad's bf16 output [batch, rows, columns] as the epilogues' tile stores write it, one warp
// box at a time (kernels/gemm/warp_boxes.cuh).
CUtensorMap make_warp_box_map(const void* base, uint64_t batch, uint64_t rows, uint64_t columns,
                              const char* argument);

}  // namespace mok::gemm
