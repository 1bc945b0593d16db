#include "reference/schedule.hpp"

namespace mok::reference {

ExpertSchedule build_schedule(const LayerShape& shape, std::span<const TokenBatch> ranks) {
  ExpertSchedule schedule;
  schedule.offsets.assign(static_cast<size_t>(shape.num_experts) + 1, 0);
  // Counting pass, then a stable placement pass: rows land in (rank, token) order per expert.
  for (const TokenBatch& batch : ranks) {
    for (int64_t index = 0; index < batch.topk_idx.numel(); ++index) {
      const int32_t expert = batch.topk_idx.data[index];
      if (expert >= 0) ++schedule.offsets[expert + 1];
    }
  }
  for (int64_t expert = 0; expert < shape.num_experts; ++expert) {
    schedule.offsets[expert + 1] += schedule.offsets[expert];
  }
  schedule.rows.resize(static_cast<size_t>(schedule.offsets.back()));
  std::vector<int64_t> cursor(schedule.offsets.begin(), schedule.offsets.end() - 1);
  for (size_t rank = 0; rank < ranks.size(); ++rank) {
    const TokenBatch& batch = ranks[rank];
    const int64_t num_tokens = batch.x.shape[0];
    for (int64_t token = 0; token < num_tokens; ++token) {
      for (int64_t slot = 0; slot < shape.top_k; ++slot) {
        const int32_t expert = batch.topk_idx.data[token * shape.top_k + slot];
        if (expert < 0) continue;
        schedule.rows[cursor[expert]++] = {static_cast<int32_t>(rank), static_cast<int32_t>(token),
                                           static_cast<int32_t>(slot)};
      }
    }
  }
  return schedule;
}

std::vector<int32_t> ExpertSchedule::expert_of_rows() const {
  std::vector<int32_t> experts(rows.size());
  for (size_t expert = 0; expert + 1 < offsets.size(); ++expert) {
    for (int64_t row = offsets[expert]; row < offsets[expert + 1]; ++row) {
      experts[static_cast<size_t>(row)] = static_cast<int32_t>(expert);
    }
  }
  return experts;
}

}  // namespace mok::reference
