// How a chunked backward (LayerBackwardOptions::chunk_rows) cuts the routed experts into chunks
// of whole experts, on the device (expert_chunks.cuh) and in the host tests: one definition.
//
// The experts are packed in order, greedily: a chunk ends before the first expert whose rows would
// take it past `capacity` rows. An expert holds at most T rows (its ids in a token's top-k are
// distinct: the schedule checks), so with capacity = T + S every chunk but the last holds more
// than S rows, and any two chunks in a row more than the capacity: a call of T tokens has at most
// min(ceil(T k / S), 2 ceil(T k / capacity) - 1) chunks (expert_chunk_bound).
#pragma once

#include <cstdint>

#include "mok/detail/numerics.hpp"

namespace mok::megakernel {

// One chunk's tables, ExpertChunk::ints(E_l, capacity) int32 (chunk c's at c times that in one
// allocation for every chunk), which the chunk's steps read in place of the workspace's.
struct ExpertChunk {
  int32_t* window;      // (2): first expert row of the chunk, its rows
  int32_t* range;       // (2): the chunk's experts [first, end) (the grouped GEMMs' expert_range:
                        // their tiles are found among these alone; first = end: none)
  int32_t* counts;      // (E_l): rows of each expert in the chunk, -1 outside it (the grouped
                        // GEMMs then leave it out, a wgrad writing nothing for it)
  int32_t* offsets;     // (E_l + 1): first row of each expert within the chunk's rows
  int32_t* row_source;  // (capacity): the workspace's row_source of the chunk's rows

  static MOK_HOST_DEVICE int64_t ints(int64_t experts, int64_t capacity) {
    return 2 + 2 + experts + (experts + 1) + capacity;
  }
  // Chunk `index`'s tables in the allocation at `base` (every chunk's, each of `capacity` rows).
  static MOK_HOST_DEVICE ExpertChunk at(int32_t* base, int64_t experts, int64_t capacity,
                                        int64_t index = 0) {
    int32_t* const table = base + index * ints(experts, capacity);
    return {table, table + 2, table + 4, table + 4 + experts, table + 4 + 2 * experts + 1};
  }
};

struct ExpertRange {
  int32_t first, end;  // experts [first, end); first = end = E_l: an empty chunk
};

// Chunk `index`'s experts, from the experts' row counts (E_l of them); an index past the last
// chunk gets an empty range.
MOK_HOST_DEVICE ExpertRange expert_chunk_range(const int32_t* counts, int32_t experts,
                                               int32_t index, int64_t capacity) {
  ExpertRange range{experts, experts};
  int32_t current = 0;
  int64_t rows = 0;
  for (int32_t expert = 0; expert < experts; ++expert) {
    const int32_t count = counts[expert];
    if (rows > 0 && rows + count > capacity) {  // the expert starts the next chunk
      if (current == index) break;
      ++current;
      rows = 0;
    }
    rows += count;
    if (current == index) {
      if (range.first == experts) range.first = expert;
      range.end = expert + 1;
    }
  }
  return range;
}

// The chunks a chunked backward of num_tokens tokens enqueues (the host does not know the
// routing): the most the packing can make of up to T k rows, each expert's at most T, at least 1.
// Two bounds, the tighter taken: two chunks in a row hold more than `capacity` rows (the second's
// first expert did not fit the first), so n chunks hold more than floor(n / 2) capacities and
// n <= 2 ceil(T k / capacity) - 1; and every chunk but the last holds more than capacity - T rows.
MOK_HOST_DEVICE int64_t expert_chunk_bound(int64_t num_tokens, int64_t top_k, int64_t experts,
                                           int64_t capacity) {
  const int64_t rows = num_tokens * top_k;
  if (rows <= capacity || experts <= 1) return 1;
  int64_t bound = 2 * ((rows + capacity - 1) / capacity) - 1;
  const int64_t spare = capacity - num_tokens;
  if (spare > 0 && (rows + spare - 1) / spare < bound) bound = (rows + spare - 1) / spare;
  return bound < experts ? bound : experts;
}

}  // namespace mok::megakernel
