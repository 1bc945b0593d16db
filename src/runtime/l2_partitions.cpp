// The L2 partition probe's reading (l2_partitions.hpp), on the host: testable without a GPU.
#include "runtime/l2_partitions.hpp"

#include <algorithm>
#include <cmath>

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
  // Each side's standard deviation, not its range: one H100 measured 278-315 and 357-401 cycles,
  // a gap of 42 narrower than the far side's range (44) but four of its deviations (~10).
  const auto deviation = [&](size_t begin, size_t end) {
    double mean = 0, squares = 0;
    for (size_t i = begin; i < end; ++i) mean += sorted[i];
    mean /= static_cast<double>(end - begin);
    for (size_t i = begin; i < end; ++i) squares += (sorted[i] - mean) * (sorted[i] - mean);
    return std::sqrt(squares / static_cast<double>(end - begin));
  };
  const double spread = std::max(deviation(0, widest), deviation(widest, sorted.size()));
  const size_t fewest = std::max<size_t>(1, sorted.size() / 8);
  if (gap < min_gap_cycles || gap < 3 * spread || widest < fewest ||
      sorted.size() - widest < fewest) {
    return partition;
  }
  const double cut = (sorted[widest - 1] + sorted[widest]) / 2;
  for (int cta = 1; cta < ctas; ++cta) partition[cta] = mean_latency[cta] > cut ? 1 : 0;
  *num_partitions = 2;
  return partition;
}

}  // namespace mok::runtime
