// Warpgroup matrix multiply (wgmma, sm_90a) for bf16 operands in shared memory with fp32
// accumulators, and the shared-memory matrix descriptors it reads.
//
// Every operand tile mok feeds to wgmma is written by TMA with the 128-byte swizzle, so one
// descriptor format covers all of them:
//   K-major  (rows of 64 K elements = 128 B): 8-row core groups 1024 B apart (SBO); stepping K
//            by 16 inside the swizzle atom adds 32 B to the start address.
//   MN-major (rows of 64 M/N elements = 128 B, one row per k): 8-k groups 1024 B apart (SBO),
//            64-element M/N panels `kPanelBytes` apart (LBO); stepping K by 16 adds 2048 B.
#pragma once

#include <cstdint>

namespace mok::ptx {

__device__ __forceinline__ uint64_t make_smem_descriptor(uint32_t smem_address,
                                                         uint32_t leading_byte_offset,
                                                         uint32_t stride_byte_offset) {
  constexpr uint64_t kSwizzle128B = 1;
  return static_cast<uint64_t>((smem_address & 0x3ffff) >> 4) |
         (static_cast<uint64_t>((leading_byte_offset & 0x3ffff) >> 4) << 16) |
         (static_cast<uint64_t>((stride_byte_offset & 0x3ffff) >> 4) << 32) | (kSwizzle128B << 62);
}

// Orders this warpgroup's register and shared-memory accesses before the wgmma that follow.
__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
}

__device__ __forceinline__ void wgmma_commit_group() {
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}

// Waits until at most kPending committed groups of this warpgroup are still in flight.
template <int kPending>
__device__ __forceinline__ void wgmma_wait_group() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(kPending) : "memory");
}

// NOTE: keeps the compiler from moving accesses to an accumulator register across the
// asynchronous wgmma that owns it.
__device__ __forceinline__ void fence_operand(float& value) {
  asm volatile("" : "+f"(value)::"memory");
}

// D(64, 256) += A(64, 16) · B(16, 256); fp32 accumulators, 128 registers per
// thread; accumulate = 0 overwrites D instead of adding to it.
// clang-format off: the operand lists keep the PTX's register numbering readable.
template <int kTransposeA, int kTransposeB>
struct Wgmma64x256 {
  static constexpr int kN = 256;
  static constexpr int kNumAccumulators = 128;
  __device__ __forceinline__ static void mma(uint64_t descriptor_a, uint64_t descriptor_b,
                                             uint32_t accumulate, float (&d)[128]) {
    asm volatile(
        "{\n"
        ".reg .pred accumulate;\n"
        "setp.ne.b32 accumulate, %130, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16\n"
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15,"
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31,"
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47,"
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63,"
        "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79,"
        "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95,"
        "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111,"
        "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127},\n"
        " %128, %129, accumulate, 1, 1, %131, %132;\n"
        "}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
          "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
          "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),
          "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
          "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]),
          "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]),
          "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]),
          "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]),
          "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]),
          "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]),
          "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]),
          "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]),
          "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]),
          "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),
          "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]),
          "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]),
          "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]),
          "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
        : "l"(descriptor_a), "l"(descriptor_b), "r"(accumulate), "n"(kTransposeA),
          "n"(kTransposeB));
  }
};

// D(64, 128) += A(64, 16) · B(16, 128); fp32 accumulators, 64 registers per thread. The ping-pong
// engine's consumer covers its (128, 128) tile with two of these sharing B.
template <int kTransposeA, int kTransposeB>
struct Wgmma64x128 {
  static constexpr int kN = 128;
  static constexpr int kNumAccumulators = 64;
  __device__ __forceinline__ static void mma(uint64_t descriptor_a, uint64_t descriptor_b,
                                             uint32_t accumulate, float (&d)[64]) {
    asm volatile(
        "{\n"
        ".reg .pred accumulate;\n"
        "setp.ne.b32 accumulate, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16\n"
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15,"
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31,"
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47,"
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63},\n"
        " %64, %65, accumulate, 1, 1, %67, %68;\n"
        "}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
          "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
          "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),
          "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
          "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]),
          "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]),
          "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]),
          "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]),
          "+f"(d[63])
        : "l"(descriptor_a), "l"(descriptor_b), "r"(accumulate), "n"(kTransposeA),
          "n"(kTransposeB));
  }
};

// D(64, 8) += A(64, 16) · B(16, 8): the narrow shape of the carried tails
// (gemm/carried_tail.cuh); 4 accumulators per thread.
template <int kTransposeA, int kTransposeB>
struct Wgmma64x8 {
  static constexpr int kN = 8;
  static constexpr int kNumAccumulators = 4;
  __device__ __forceinline__ static void mma(uint64_t descriptor_a, uint64_t descriptor_b,
                                             uint32_t accumulate, float (&d)[4]) {
    asm volatile(
        "{\n"
        ".reg .pred accumulate;\n"
        "setp.ne.b32 accumulate, %6, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16\n"
        "{%0, %1, %2, %3},\n"
        " %4, %5, accumulate, 1, 1, %7, %8;\n"
        "}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "l"(descriptor_a), "l"(descriptor_b), "r"(accumulate), "n"(kTransposeA),
          "n"(kTransposeB));
  }
};

// clang-format on

}  // namespace mok::ptx
