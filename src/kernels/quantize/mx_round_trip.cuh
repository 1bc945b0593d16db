// The mxfp8 layer's operands on the bf16 engine (precision mode mxfp8 on Hopper, docs/quantize.md):
// a tensor quantized to mxfp8 and dequantized again, written as bf16, in one pass. A dequantized
// value is an E4M3 value times a power of two, exact in bf16 but below 2^-130 (fp8::mx_round_trip),
// and a bf16 GEMM's products are exact in fp32, so a bf16 GEMM on these operands sums the same
// products as the reference's block GEMM (src/reference/block_scaled.cpp), in another order.
//
//   mx_rows_kernel      blocks of 1 x 32 along each row (the rows' own values: bf16 or fp32)
//   mx_columns_kernel   blocks of 32 x 1 down the rows of each group (an expert's rows, from its
//                       first; the weights' rows of one matrix), the rows past a group's count not
//                       touched; in place allowed. Gate/up groups (MxColumnGroups::gate_up) hold
//                       2I rows interleaved by 8 (gemm::interleave_gate_up): a block is 32 rows of
//                       W_gate or of W_up alone, as the reference quantizes each matrix on its own.
//
// The amax and E8M0 rules are those of the quantizers (fp8_numerics.hpp): NaN and ±Inf are
// skipped by the block's amax and stay NaN.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/quantize/elements.cuh"
#include "kernels/quantize/gate_up_columns.cuh"
#include "mok/detail/fp8_numerics.hpp"

namespace mok::quantize {

inline constexpr int kMxBlock = 32;
inline constexpr int kMxThreads = 256;

// bf16 bits of v, rounded to nearest even (exact for a round-tripped value).
__device__ __forceinline__ uint32_t mx_bf16_bits(float value) {
  return static_cast<uint32_t>(__bfloat16_as_ushort(__float2bfloat16_rn(value)));
}

// The E8M0 code of a block from its largest finite magnitude's bits.
__device__ __forceinline__ uint8_t mx_code(uint32_t amax_bits) {
  return fp8::e8m0_scale_code(__uint_as_float(amax_bits));
}

// fp8::mx_round_trip(value, code) with the hardware's conversions, given code's factor
// (e8m0_inverse) and scale (e8m0_to_float): the same value for every float (the encoding is
// encode_scaled's rule, checked against fp8::encode_e4m3 for every float by
// tests/gpu/test_quantize.cu; the decoding is exact).
__device__ __forceinline__ float mx_round_trip_fast(float value, float inverse, float scale) {
  const uint32_t bits = __float_as_uint(value);
  const uint32_t code = (bits & fp8::kFloatExponentMask) == fp8::kFloatExponentMask
                            ? ((bits >> 24) & fp8::kSignBit) | fp8::kE4M3NanCode
                            : ptx::cvt_e4m3x2(__fmul_rn(value, inverse), 0.0f);
  return __fmul_rn(ptx::e4m3_to_float(code), scale);
}

// A block's round trip: its code's factor and scale, once.
struct MxBlockScale {
  float inverse, scale;
  __device__ __forceinline__ explicit MxBlockScale(uint8_t code)
      : inverse(fp8::e8m0_inverse(code)), scale(fp8::e8m0_to_float(code)) {}
  __device__ __forceinline__ float operator()(float value) const {
    return mx_round_trip_fast(value, inverse, scale);
  }
};

// in (rows, cols) -> out (rows, cols) bf16 bits, each 1 x 32 block round-tripped; the rows below
// *row_bound (device; null: rows). cols a multiple of 32. A lane per 16-byte input vector, a block
// in 4 (bf16) or 8 (fp32) lanes, its amax by shuffles (the quantize kernels' layout); any grid.
template <class Input>
__global__ void __launch_bounds__(kMxThreads)
    mx_rows_kernel(const Input* __restrict__ in, uint16_t* __restrict__ out, int64_t rows,
                   int64_t cols, const int32_t* __restrict__ row_bound) {
  using Vector = InputVector<Input>;
  constexpr int kElements = Vector::kElements;
  constexpr int kLanes = kMxBlock / kElements;
  const int64_t num_rows = row_bound != nullptr ? static_cast<int64_t>(*row_bound) : rows;
  const int64_t num_vectors = num_rows * cols / kElements;
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / 32);
  // (the loop's bound is the warp's: every lane takes part in the shuffles)
  for (int64_t base =
           (static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32) * 32;
       base < num_vectors; base += warps * 32) {
    const int64_t vector = base + lane;
    const bool active =
        vector < num_vectors;  // (whole blocks: num_vectors is a multiple of kLanes)
    float values[kElements] = {};
    if (active) Vector::load(in + vector * kElements, values);
    const MxBlockScale round_trip(mx_code(lanes_max<kLanes>(finite_amax_bits(values))));
    if (!active) continue;
    uint32_t words[kElements / 2];
#pragma unroll
    for (int w = 0; w < kElements / 2; ++w) {
      words[w] = mx_bf16_bits(round_trip(values[2 * w])) |
                 (mx_bf16_bits(round_trip(values[2 * w + 1])) << 16);
    }
    if constexpr (kElements == 8) {
      *reinterpret_cast<uint4*>(out + vector * 8) =
          make_uint4(words[0], words[1], words[2], words[3]);
    } else {
      *reinterpret_cast<uint2*>(out + vector * 4) = make_uint2(words[0], words[1]);
    }
  }
}

// The groups of rows mx_columns_kernel takes its 32 x 1 blocks from: group g is rows
// [offsets[g], offsets[g] + counts[g]) (offsets, counts on the device; counts null: up to
// offsets[g + 1]); offsets null: uniform groups of group_rows rows from row g * group_rows.
struct MxColumnGroups {
  const int32_t* offsets = nullptr;
  const int32_t* counts = nullptr;
  int64_t group_rows = 0;
  int num_groups = 0;
  // The group's rows are W_gate's and W_up's interleaved in blocks of 8 (gate row i at
  // 16 (i / 8) + i % 8, up row i 8 further): blocks of 32 gate rows, then of 32 up rows.
  bool gate_up = false;

  __device__ __forceinline__ int64_t first(int group) const {
    return offsets != nullptr ? offsets[group] : group * group_rows;
  }
  __device__ __forceinline__ int64_t count(int group) const {
    if (offsets == nullptr) return group_rows;
    return counts != nullptr ? counts[group] : offsets[group + 1] - offsets[group];
  }
  // The group's row of logical row r (gate rows, then up rows, when gate_up).
  __device__ __forceinline__ int64_t row(int64_t r, int64_t count) const {
    return gate_up ? GateUp8Columns{count / 2}(r) : r;
  }
};

// in (rows, cols) -> out (rows, cols) bf16 bits (may be in's bytes when Input is bf16): every
// group's 32 x 1 blocks round-tripped, a block starting at each group's first row (the last one
// partial: the rows past the count are neither read nor written). cols a multiple of the input's
// vector (8 bf16, 4 fp32). Grid (any x, groups on y with a stride); a thread per block of 32 rows
// and one input vector of columns: two passes over the block (amax, then values), the second
// reading what the first brought into the cache.
template <class Input>
__global__ void __launch_bounds__(kMxThreads)
    mx_columns_kernel(const Input* in, uint16_t* out, int64_t cols, MxColumnGroups groups) {
  using Vector = InputVector<Input>;
  constexpr int kColumns = Vector::kElements;
  const int64_t vectors_per_row = cols / kColumns;
  for (int group = blockIdx.y; group < groups.num_groups; group += gridDim.y) {
    const int64_t first = groups.first(group), count = groups.count(group);
    const int64_t blocks = (count + kMxBlock - 1) / kMxBlock;
    for (int64_t item = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
         item < blocks * vectors_per_row; item += static_cast<int64_t>(gridDim.x) * blockDim.x) {
      const int64_t block = item / vectors_per_row;
      const int64_t column = item % vectors_per_row * kColumns;
      const int64_t r0 = block * kMxBlock;
      const int n = static_cast<int>(count - r0 < kMxBlock ? count - r0 : kMxBlock);
      uint32_t amax_bits[kColumns] = {};
      for (int r = 0; r < n; ++r) {
        float values[kColumns];
        Vector::load(in + (first + groups.row(r0 + r, count)) * cols + column, values);
#pragma unroll
        for (int c = 0; c < kColumns; ++c) {
          amax_bits[c] = max(amax_bits[c], fp8::finite_magnitude_bits(values[c]));
        }
      }
      float inverse[kColumns], scale[kColumns];
#pragma unroll
      for (int c = 0; c < kColumns; ++c) {
        const uint8_t code = mx_code(amax_bits[c]);
        inverse[c] = fp8::e8m0_inverse(code);
        scale[c] = fp8::e8m0_to_float(code);
      }
      for (int r = 0; r < n; ++r) {
        const int64_t offset = (first + groups.row(r0 + r, count)) * cols + column;
        float values[kColumns];
        Vector::load(in + offset, values);
        uint32_t words[kColumns / 2];
#pragma unroll
        for (int w = 0; w < kColumns / 2; ++w) {
          words[w] = mx_bf16_bits(mx_round_trip_fast(values[2 * w], inverse[2 * w], scale[2 * w])) |
                     (mx_bf16_bits(mx_round_trip_fast(values[2 * w + 1], inverse[2 * w + 1],
                                                      scale[2 * w + 1]))
                      << 16);
        }
        if constexpr (kColumns == 8) {
          *reinterpret_cast<uint4*>(out + offset) =
              make_uint4(words[0], words[1], words[2], words[3]);
        } else {
          *reinterpret_cast<uint2*>(out + offset) = make_uint2(words[0], words[1]);
        }
      }
    }
  }
}

}  // namespace mok::quantize
