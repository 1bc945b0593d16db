// The fp8 backward's expert rows of one rank alone (EP 1), quantized where they are gathered: each
// expert row is its token's x row and dy row (row_source), which the unfused path first copied
// into bf16 expert rows (the dispatch by token) and then read again for three quantizations: dy's
// 1 x 128 rows (the down dgrad's A), x's and dy's 128 x 1 blocks down each expert's rows (the
// wgrads' operands), and in recompute mode x's 1 x 128 rows. Here a CTA takes one 128-row block of
// an expert and 128 columns of H, gathers both tensors' pieces of those rows from the tokens into
// shared memory, and writes all of them from there. The bytes are the quantizers' (the same
// amax, scale and encoding; rows past the expert's count read as zeros in the 128 x 1 blocks, and
// get no 1 x 128 codes, as no GEMM reads them).
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/comm/workspace_layout.cuh"
#include "kernels/ptx/cp_async.cuh"
#include "kernels/quantize/elements.cuh"
#include "kernels/quantize/layer_kernels.cuh"

namespace mok::megakernel {

inline constexpr int kExpertRowsBlock = 128;  // rows and columns of a CTA's tile
inline constexpr int kExpertRowsThreads = 256;
inline constexpr int kExpertRowsCtasPerSm = 3;                 // as many as the shared tiles fit
inline constexpr int kExpertRowsWords = kExpertRowsBlock / 2;  // bf16 pairs of a tile row
// x's and dy's tiles: (2, 128 rows, 64 words), then the tile rows' tokens.
inline constexpr size_t kExpertRowsSharedBytes =
    2 * kExpertRowsBlock * kExpertRowsWords * sizeof(uint32_t) + kExpertRowsBlock * sizeof(int32_t);
static_assert(2 * kExpertRowsBlock == kExpertRowsThreads,
              "a thread per column of each tensor in the 128 x 1 pass");

struct Fp8Codes {
  uint8_t* data;
  float* scales;
};

struct ExpertRowsFp8 {
  const __nv_bfloat16* x;        // (T, H): this rank's tokens
  const __nv_bfloat16* dy;       // (T, H)
  int hidden;                    // H, a multiple of 128
  int64_t padded_rows;           // the 128 x 1 operands' rows: a multiple of 128
  quantize::ExpertRows experts;  // where each 128-row block's real rows end
  Fp8Codes dy_rows;              // (rows, H) and (rows, H / 128): 1 x 128
  Fp8Codes x_rows;               // the same for x, or data null (save mode: not needed)
  Fp8Codes dy_t;                 // (H, padded_rows) and (H, padded_rows / 128): 128 x 1
  Fp8Codes x_t;
};

// Row `tile_row` of a staged tile as 1 x 128 codes, a warp: lane l holds columns 4 l .. 4 l + 3.
__device__ inline void quantize_staged_bf16_row(const uint32_t* tile_row, Fp8Codes out, int64_t row,
                                                int hidden, int chunk, int lane) {
  using quantize::Format;
  const uint32_t low = tile_row[2 * lane], high = tile_row[2 * lane + 1];
  const float values[4] = {__uint_as_float(low << 16), __uint_as_float(low & 0xffff0000u),
                           __uint_as_float(high << 16), __uint_as_float(high & 0xffff0000u)};
  const float amax = __uint_as_float(quantize::lanes_max<32>(quantize::finite_amax_bits(values)));
  uint32_t words[1];
  quantize::encode_scaled(values, quantize::block_inverse<Format::kFp8>(amax), words);
  quantize::store_codes<4>(out.data + row * hidden + chunk * kExpertRowsBlock + 4 * lane, words);
  if (lane == 0) {
    quantize::store_scale<Format::kFp8>(out.scales, row * (hidden / kExpertRowsBlock) + chunk,
                                        amax);
  }
}

// Column `column` of a staged tile (128 rows of bf16 pairs) as one 128 x 1 block.
__device__ inline void quantize_staged_bf16_column(const uint32_t* tile, Fp8Codes out,
                                                   int64_t data_row, int64_t padded_rows,
                                                   int64_t row0, int column) {
  using quantize::Format;
  constexpr int kGroups = kExpertRowsBlock / 4;
  const int word = column / 2, shift = column % 2 == 0 ? 16 : 0;
  const auto value = [&](int row) {
    const uint32_t bits = tile[row * kExpertRowsWords + word];
    return __uint_as_float(shift == 16 ? bits << 16 : bits & 0xffff0000u);
  };
  uint32_t amax_bits = 0;
#pragma unroll 8
  for (int group = 0; group < kGroups; ++group) {
    const float four[4] = {value(4 * group), value(4 * group + 1), value(4 * group + 2),
                           value(4 * group + 3)};
    amax_bits = max(amax_bits, quantize::finite_amax_bits(four));
  }
  const float amax = __uint_as_float(amax_bits);
  const float inverse = quantize::block_inverse<Format::kFp8>(amax);
  // (in two halves of 64 rows: the whole column's codes at once cost a spill)
  constexpr int kHalf = kGroups / 2;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    uint32_t codes[kHalf];
#pragma unroll
    for (int group = 0; group < kHalf; ++group) {
      const int first = 4 * (half * kHalf + group);
      const float four[4] = {value(first), value(first + 1), value(first + 2), value(first + 3)};
      uint32_t bits[1];
      quantize::encode_scaled(four, inverse, bits);
      codes[group] = bits[0];
    }
    quantize::store_codes<kExpertRowsBlock / 2>(
        out.data + data_row * padded_rows + row0 + half * (kExpertRowsBlock / 2), codes);
  }
  quantize::store_scale<Format::kFp8>(
      out.scales, data_row * (padded_rows / kExpertRowsBlock) + row0 / kExpertRowsBlock, amax);
}

// grid: padded_rows / 128 * H / 128 CTAs of kExpertRowsThreads, kExpertRowsSharedBytes of dynamic
// shared memory (its first, 16-byte aligned).
__device__ inline void quantize_expert_rows(const comm::WorkspaceView& view,
                                            const ExpertRowsFp8& rows, uint32_t* shared) {
  const int chunks = rows.hidden / kExpertRowsBlock;
  const int chunk = static_cast<int>(blockIdx.x % chunks);
  const int64_t row0 = static_cast<int64_t>(blockIdx.x / chunks) * kExpertRowsBlock;
  const int64_t row_end = rows.experts.end(row0, rows.padded_rows);
  if (row_end <= row0) return;  // (the whole CTA: before any barrier)
  constexpr int kTile = kExpertRowsBlock * kExpertRowsWords;
  uint32_t* tiles = shared;  // x's, then dy's
  auto* tokens = reinterpret_cast<int32_t*>(shared + 2 * kTile);
  const int thread = static_cast<int>(threadIdx.x);
  if (thread < kExpertRowsBlock) {
    const int64_t row = row0 + thread;
    const int32_t packed = row < row_end ? view.row_source()[row] : -1;
    tokens[thread] = packed < 0 ? -1 : comm::unpack_row_source(view.layout, packed).token;
  }
  __syncthreads();
  // 16-byte pieces: (tensor, tile row, piece of 16 in the row's 256 bytes).
  constexpr int kPieces = 2 * kExpertRowsBlock * 16;
  for (int piece = thread; piece < kPieces; piece += kExpertRowsThreads) {
    const int tensor = piece / (kExpertRowsBlock * 16);
    const int tile_row = piece / 16 % kExpertRowsBlock;
    const int vector = piece % 16;
    uint32_t* destination = tiles + tensor * kTile + tile_row * kExpertRowsWords + vector * 4;
    const int32_t token = tokens[tile_row];
    if (token >= 0) {
      const __nv_bfloat16* source = (tensor == 0 ? rows.x : rows.dy) +
                                    static_cast<int64_t>(token) * rows.hidden +
                                    chunk * kExpertRowsBlock + vector * 8;
      ptx::cp_async_16(destination, source);
    } else {
      *reinterpret_cast<uint4*>(destination) = make_uint4(0, 0, 0, 0);
    }
  }
  ptx::cp_async_wait_all();
  __syncthreads();
  // 1 x 128: dy's rows (and x's in recompute mode), a warp a row.
  const int lane = thread % 32, warp = thread / 32;
  for (int tile_row = warp; tile_row < kExpertRowsBlock; tile_row += kExpertRowsThreads / 32) {
    if (tokens[tile_row] < 0) continue;  // (the whole warp)
    quantize_staged_bf16_row(tiles + kTile + tile_row * kExpertRowsWords, rows.dy_rows,
                             row0 + tile_row, rows.hidden, chunk, lane);
    if (rows.x_rows.data != nullptr) {
      quantize_staged_bf16_row(tiles + tile_row * kExpertRowsWords, rows.x_rows, row0 + tile_row,
                               rows.hidden, chunk, lane);
    }
  }
  // 128 x 1: a thread per column of x (threads 0-127) or of dy (128-255).
  const int tensor = thread / kExpertRowsBlock, column = thread % kExpertRowsBlock;
  quantize_staged_bf16_column(tiles + tensor * kTile, tensor == 0 ? rows.x_t : rows.dy_t,
                              static_cast<int64_t>(chunk) * kExpertRowsBlock + column,
                              rows.padded_rows, row0, column);
}

}  // namespace mok::megakernel
