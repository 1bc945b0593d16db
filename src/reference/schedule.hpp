// The CPU counterpart of the GPU schedule: for every expert, the rows it computes, in global
// token order (source rank, then token), whichever rank sent them. This one order fixes every
// floating-point reduction over an expert's rows, which makes results EP-invariant.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "mok/layer.hpp"

namespace mok::reference {

struct RowRef {
  int32_t rank;   // source rank of the token
  int32_t token;  // token index on that rank
  int32_t slot;   // j: position in the token's top-k list
};

struct ExpertSchedule {
  std::vector<int64_t> offsets;  // (E + 1): rows of expert e are rows[offsets[e] .. offsets[e+1])
  std::vector<RowRef> rows;      // (sum of counts)

  int64_t num_rows(int64_t expert) const { return offsets[expert + 1] - offsets[expert]; }
  // The expert of each row (rows).
  std::vector<int32_t> expert_of_rows() const;
};

ExpertSchedule build_schedule(const LayerShape& shape, std::span<const TokenBatch> ranks);

}  // namespace mok::reference
