// Builds CUtensorMaps through the driver entry point the runtime hands out, so mok links only
// the CUDA runtime.
#include "runtime/gemm_tensor_map.hpp"

#include <cuda_runtime.h>

#include "kernels/gemm/warp_boxes.cuh"
#include "mok/cuda_check.hpp"
#include "mok/error.hpp"

namespace mok::gemm {
namespace {

using EncodeTiled = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*,
                                 const cuuint64_t*, const cuuint64_t*, const cuuint32_t*,
                                 const cuuint32_t*, CUtensorMapInterleave, CUtensorMapSwizzle,
                                 CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

EncodeTiled encode_tiled() {
  static const EncodeTiled function = [] {
    void* pointer = nullptr;
    cudaDriverEntryPointQueryResult query = cudaDriverEntryPointSymbolNotFound;
    MOK_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &pointer, 12000,
                                                    cudaEnableDefault, &query));
    if (query != cudaDriverEntryPointSuccess || pointer == nullptr) {
      throw Error("cuda", "cuTensorMapEncodeTiled not found in the driver");
    }
    return reinterpret_cast<EncodeTiled>(pointer);
  }();
  return function;
}

CUtensorMap encode(const void* base, cuuint32_t rank, const cuuint64_t* dims,
                   const cuuint64_t* strides, const cuuint32_t* box, const char* argument) {
  MOK_CHECK_ARG(reinterpret_cast<uintptr_t>(base) % 16 == 0, argument, "address ", base,
                " is not 16-byte aligned");
  const cuuint32_t element_strides[3] = {1, 1, 1};
  CUtensorMap map;
  const CUresult status = encode_tiled()(
      &map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, rank, const_cast<void*>(base), dims, strides, box,
      element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
      CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  MOK_CHECK_ARG(status == CUDA_SUCCESS, argument, "cuTensorMapEncodeTiled failed with ",
                static_cast<int>(status), " (dims ", dims[0], " x ", dims[1], ")");
  return map;
}

}  // namespace

CUtensorMap make_tensor_map_2d(const void* base, uint64_t rows, uint64_t columns, uint32_t box_rows,
                               const char* argument) {
  MOK_CHECK_ARG(columns % 8 == 0, argument, "row length ", columns,
                " must be a multiple of 8 elements (16-byte rows for TMA)");
  const cuuint64_t dims[2] = {columns, rows};
  const cuuint64_t strides[1] = {columns * 2};
  const cuuint32_t box[2] = {64, box_rows};
  return encode(base, 2, dims, strides, box, argument);
}

CUtensorMap make_tensor_map_3d(const void* base, uint64_t batch, uint64_t rows, uint64_t columns,
                               uint32_t box_rows, uint32_t box_columns, const char* argument) {
  MOK_CHECK_ARG(columns % 8 == 0, argument, "row length ", columns,
                " must be a multiple of 8 elements (16-byte rows for TMA)");
  const cuuint64_t dims[3] = {columns, rows, batch};
  const cuuint64_t strides[2] = {columns * 2, rows * columns * 2};
  const cuuint32_t box[3] = {box_columns, box_rows, 1};
  return encode(base, 3, dims, strides, box, argument);
}

CUtensorMap make_warp_box_map(const void* base, uint64_t batch, uint64_t rows, uint64_t columns,
                              const char* argument) {
  return make_tensor_map_3d(base, batch, rows, columns, kWarpBoxRows, kWarpBoxColumns, argument);
}

}  // namespace mok::gemm
