// Warpgroup matrix multiply (wgmma, sm_90a) for E4M3 operands in shared memory with fp32
// accumulators: K = 32 per instruction (32 bytes of a 128-byte swizzle row), both operands
// K-major (the only layout PTX allows for 8-bit types, hence no transpose immediates).
//
// The descriptors are wgmma.cuh's make_smem_descriptor: a K-major tile written by TMA with the
// 128-byte swizzle has 8-row core groups 1024 B apart (SBO), and stepping K by 32 inside the
// swizzle row adds 32 B to the start address, as stepping 16 bf16 does.
//
// NOTE: the tensor cores add E4M3 products at a precision below fp32 (DeepSeek-V3 reports about
// 14 bits kept), so a caller sums at most one 128-wide K block per fresh accumulator set and
// promotes it into fp32 itself (gemm/fp8_mainloop.cuh).
#pragma once

#include <cstdint>

namespace mok::ptx {

template <int kN>
struct WgmmaFp8;

// clang-format off: the operand lists keep the PTX's register numbering readable.
// D(64, 128) (+)= A(64, 32) · B(32, 128), E4M3 operands (K-major, both), fp32 accumulators,
// 64 registers per thread; accumulate = 0 overwrites D instead of adding to it.
template <>
struct WgmmaFp8<128> {
  static constexpr int kN = 128;
  static constexpr int kNumAccumulators = 64;
  __device__ __forceinline__ static void mma(uint64_t descriptor_a, uint64_t descriptor_b,
                                             uint32_t accumulate, float (&d)[64]) {
    asm volatile(
        "{\n"
        ".reg .pred accumulate;\n"
        "setp.ne.b32 accumulate, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3\n"
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15,"
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31,"
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47,"
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63},\n"
        " %64, %65, accumulate, 1, 1;\n"
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
        : "l"(descriptor_a), "l"(descriptor_b), "r"(accumulate));
  }
};

// clang-format on

}  // namespace mok::ptx
