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
// x's and dy's tiles: (2, 128 rows, 64 words), then the tile rows' tokens, then the 128 x 1
// pass's exchange (2 tensors, 64 column pairs, 2 halves).
inline constexpr size_t kExpertRowsSharedBytes =
    2 * kExpertRowsBlock * kExpertRowsWords * sizeof(uint32_t) +
    kExpertRowsBlock * sizeof(int32_t) + 2 * kExpertRowsWords * 2 * sizeof(uint32_t);
static_assert(2 * kExpertRowsBlock == kExpertRowsThreads,
              "a thread per column pair and half of each tensor in the 128 x 1 pass");

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

// Four rows of a staged tile as 1 x 128 codes, a warp: lanes 8 r .. 8 r + 7 take tile row
// `tile_row0 + r`, lane g of them words 4 g .. 4 g + 3 and 32 + 4 g .. 35 + 4 g (columns 8 g ..
// 8 g + 7 and 64 + 8 g .. 71 + 8 g), so that each eight lanes read a row's half in one pass of the
// banks. A row whose token is -1 (past the expert's rows) is read but not stored.
__device__ inline void quantize_staged_bf16_rows(const uint32_t* tile, const int32_t* tokens,
                                                 int tile_row0, Fp8Codes out, int64_t row0,
                                                 int hidden, int chunk, int lane) {
  using quantize::Format;
  const int tile_row = tile_row0 + lane / 8, group = lane % 8;
  const uint32_t* source = tile + tile_row * kExpertRowsWords + 4 * group;
  const uint4 first = *reinterpret_cast<const uint4*>(source);
  const uint4 second = *reinterpret_cast<const uint4*>(source + kExpertRowsWords / 2);
  const uint32_t words[8] = {first.x,  first.y,  first.z,  first.w,
                             second.x, second.y, second.z, second.w};
  bool finite = true;
  uint32_t amax_bits = quantize::lanes_max<8>(quantize::packed_bf16_amax_bits(words, finite));
  float values[2][8];  // the lane's columns in each half of the row
  quantize::InputVector<uint16_t>::widen(first, values[0]);
  quantize::InputVector<uint16_t>::widen(second, values[1]);
  // (a NaN's magnitude is above +Inf's, so the row's maximum tells whether all of it is finite;
  // a row that is not takes the general maximum, which the whole warp reduces)
  const bool row_finite = amax_bits < (quantize::kBf16InfBits << 16);
  if (__any_sync(0xffffffffu, !row_finite)) {
    amax_bits = quantize::lanes_max<8>(
        max(quantize::finite_amax_bits(values[0]), quantize::finite_amax_bits(values[1])));
  }
  const fp8::Fp8BlockScale scale = fp8::fp8_block_scale(__uint_as_float(amax_bits));
  uint32_t codes[2][2];
  quantize::encode_scaled(values[0], scale.inverse, row_finite, codes[0]);
  quantize::encode_scaled(values[1], scale.inverse, row_finite, codes[1]);
  if (tokens[tile_row] < 0) return;
  const int64_t row = row0 + tile_row;
  uint8_t* data = out.data + row * hidden + chunk * kExpertRowsBlock + 8 * group;
  quantize::store_codes<8>(data, codes[0]);
  quantize::store_codes<8>(data + kExpertRowsBlock / 2, codes[1]);
  if (group == 0) out.scales[row * (hidden / kExpertRowsBlock) + chunk] = scale.scale;
}

// Columns 2 `word` and 2 `word` + 1 of a staged tile (128 rows of bf16 pairs) as two 128 x 1
// blocks, two threads: `half` takes rows 64 half .. 64 half + 63 of both, its partner (the other
// half) the rest; `exchange` is two words of shared memory for each pair of them. Every thread of
// the CTA calls it (a barrier between the halves' maxima and the codes).
__device__ inline void quantize_staged_bf16_columns(const uint32_t* tile, uint32_t* exchange,
                                                    Fp8Codes out, int64_t data_row,
                                                    int64_t padded_rows, int64_t row0, int word,
                                                    int half) {
  constexpr int kRows = kExpertRowsBlock / 2;  // a thread's
  const uint32_t* column = tile + half * kRows * kExpertRowsWords + word;
  uint32_t halves = 0;
#pragma unroll 16
  for (int row = 0; row < kRows; ++row) {
    halves = quantize::max_bf16_magnitudes(halves, column[row * kExpertRowsWords]);
  }
  exchange[half] = halves;
  __syncthreads();
  halves = ptx::max_u16x2(halves, exchange[1 - half]);
  const uint32_t magnitudes[2] = {halves & 0xffffu, halves >> 16};  // column 2 word, 2 word + 1
  bool finite[2];
  float amax[2];
#pragma unroll
  for (int c = 0; c < 2; ++c) {
    finite[c] = magnitudes[c] < quantize::kBf16InfBits;
    amax[c] = __uint_as_float(magnitudes[c] << 16);
  }
  if (!finite[0] || !finite[1]) {  // (rare: the general maximum over all 128 rows)
    uint32_t bits[2] = {0, 0};
    const uint32_t* whole = tile + word;
    for (int row = 0; row < kExpertRowsBlock; ++row) {
      const uint32_t pair = whole[row * kExpertRowsWords];
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        bits[c] =
            max(bits[c], fp8::finite_magnitude_bits(quantize::staged_element<uint16_t>(pair, c)));
      }
    }
    amax[0] = __uint_as_float(bits[0]);
    amax[1] = __uint_as_float(bits[1]);
  }
  const fp8::Fp8BlockScale scale[2] = {fp8::fp8_block_scale(amax[0]),
                                       fp8::fp8_block_scale(amax[1])};
  // In two passes of 32 rows: 32 codes (two whole sectors) of each column at once.
  constexpr int kPass = 32;
#pragma unroll
  for (int pass = 0; pass < kRows / kPass; ++pass) {
    float values[2][kPass];
#pragma unroll
    for (int row = 0; row < kPass; ++row) {
      const uint32_t pair = column[(pass * kPass + row) * kExpertRowsWords];
      values[0][row] = quantize::staged_element<uint16_t>(pair, 0);
      values[1][row] = quantize::staged_element<uint16_t>(pair, 1);
    }
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      uint32_t codes[kPass / 4];
      quantize::encode_scaled(values[c], scale[c].inverse, finite[c], codes);
      quantize::store_codes<kPass>(
          out.data + (data_row + c) * padded_rows + row0 + half * kRows + pass * kPass, codes);
    }
  }
  if (half == 0) {
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      out.scales[(data_row + c) * (padded_rows / kExpertRowsBlock) + row0 / kExpertRowsBlock] =
          scale[c].scale;
    }
  }
}

// grid: padded_rows / 128 * H / 128 CTAs of kExpertRowsThreads, kExpertRowsSharedBytes of dynamic
// shared memory (its first, 16-byte aligned).
__device__ inline void quantize_expert_rows(const comm::WorkspaceView& view,
                                            const ExpertRowsFp8& rows, uint32_t* shared) {
  const int chunks = rows.hidden / kExpertRowsBlock;
  const int chunk = static_cast<int>(blockIdx.x % chunks);
  const int64_t row0 = static_cast<int64_t>(blockIdx.x / chunks) * kExpertRowsBlock;
  constexpr int kTile = kExpertRowsBlock * kExpertRowsWords;
  uint32_t* tiles = shared;  // x's, then dy's
  auto* tokens = reinterpret_cast<int32_t*>(shared + 2 * kTile);
  uint32_t* exchange = shared + 2 * kTile + kExpertRowsBlock;  // (the 128 x 1 pass)
  __shared__ int valid_rows;  // this block's real rows: the expert's rows from row0 on, <= 128
  const int thread = static_cast<int>(threadIdx.x);
  if (thread == 0) {
    const int64_t end = rows.experts.end(row0, rows.padded_rows);
    valid_rows = static_cast<int>(min(max(end - row0, int64_t{0}), int64_t{kExpertRowsBlock}));
  }
  __syncthreads();
  const int valid = valid_rows;
  if (valid == 0) return;  // (the whole CTA)
  if (thread < kExpertRowsBlock) {
    const int32_t packed = thread < valid ? view.row_source()[row0 + thread] : -1;
    tokens[thread] = packed < 0 ? -1 : comm::unpack_row_source(view.layout, packed).token;
  }
  __syncthreads();
  // 16-byte pieces: thread t takes piece t % 16 of tile rows t / 16, t / 16 + 16, ... in both.
  {
    constexpr int kRowsAtOnce = kExpertRowsThreads / 16;
    const int vector = thread % 16;
    const int64_t column0 = static_cast<int64_t>(chunk) * kExpertRowsBlock + vector * 8;
#pragma unroll
    for (int i = 0; i < kExpertRowsBlock / kRowsAtOnce; ++i) {
      const int tile_row = thread / 16 + kRowsAtOnce * i;
      const int32_t token = tokens[tile_row];
      uint32_t* destination = tiles + tile_row * kExpertRowsWords + vector * 4;
      if (token >= 0) {
        const int64_t offset = static_cast<int64_t>(token) * rows.hidden + column0;
        ptx::cp_async_16(destination, rows.x + offset);
        ptx::cp_async_16(destination + kTile, rows.dy + offset);
      } else {
        *reinterpret_cast<uint4*>(destination) = make_uint4(0, 0, 0, 0);
        *reinterpret_cast<uint4*>(destination + kTile) = make_uint4(0, 0, 0, 0);
      }
    }
  }
  ptx::cp_async_wait_all();
  __syncthreads();
  // 1 x 128: dy's rows (and x's in recompute mode), four rows a warp at once.
  const int lane = thread % 32, warp = thread / 32;
  constexpr int kWarps = kExpertRowsThreads / 32;
  for (int tile_row0 = 4 * warp; tile_row0 < valid; tile_row0 += 4 * kWarps) {
    quantize_staged_bf16_rows(tiles + kTile, tokens, tile_row0, rows.dy_rows, row0, rows.hidden,
                              chunk, lane);
    if (rows.x_rows.data != nullptr) {
      quantize_staged_bf16_rows(tiles, tokens, tile_row0, rows.x_rows, row0, rows.hidden, chunk,
                                lane);
    }
  }
  // 128 x 1: x's columns (threads 0-127) and dy's (128-255), two columns and half the rows a
  // thread.
  const int tensor = thread / kExpertRowsBlock, pair = thread % kExpertRowsBlock;
  const int half = pair / kExpertRowsWords, word = pair % kExpertRowsWords;
  quantize_staged_bf16_columns(
      tiles + tensor * kTile, exchange + 2 * (tensor * kExpertRowsWords + word),
      tensor == 0 ? rows.x_t : rows.dy_t, static_cast<int64_t>(chunk) * kExpertRowsBlock + 2 * word,
      rows.padded_rows, row0, word, half);
}

}  // namespace mok::megakernel
