// The L2 partition probe's reading (l2_partitions.hpp), on the host: testable without a GPU.
#include "runtime/l2_partitions.hpp"

#include <algorithm>

namespace mok::runtime {

std::vector<uint8_t> classify_l2_partitions(const std::vector<double>& mean_latency,
                                            int min_gap_cycles, int* num_partitions) {
  const int ctas = static_cast<int>(mean_latency.size());
  std::vector<uint8_t> partition(ctas, 0);
  *num_partitions = 1;
  if (ctas < 3) return partition;
  std::vector<double> sorted(mean_latency.begin() + 1, mean_latency.end());
  std::sort(sorted.begin(), sorted.end());
  size_t widest = 1;  // the widest gap lies between sorted[widest - 1] and sorted[widest]
  for (size_t i = 2; i < sorted.size(); ++i) {
    if (sorted[i] - sorted[i - 1] > sorted[widest] - sorted[widest - 1]) widest = i;
  }
  const double gap = sorted[widest] - sorted[widest - 1];
  const double low_spread = sorted[widest - 1] - sorted.front();
  const double high_spread = sorted.back() - sorted[widest];
  if (gap < min_gap_cycles || gap <= low_spread || gap <= high_spread) return partition;
  const double cut = (sorted[widest - 1] + sorted[widest]) / 2;
  for (int cta = 1; cta < ctas; ++cta) partition[cta] = mean_latency[cta] > cut ? 1 : 0;
  *num_partitions = 2;
  return partition;
}

}  // namespace mok::runtime
