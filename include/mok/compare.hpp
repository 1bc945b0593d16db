// Accuracy metrics against the fp64 oracle, used by the CLI's --check and by the tests.
#pragma once

#include <cstdint>
#include <span>
#include <string>

#include "mok/bf16.hpp"

namespace mok {

struct ErrorStats {
  double relative_l2 = 0;  // ||value - oracle|| / ||oracle||
  double max_abs = 0;      // max |value - oracle|
  double mean_abs = 0;
  int64_t non_finite = 0;  // NaN or Inf in value (an unwritten, poisoned element shows here)
  int64_t count = 0;

  bool within(double tolerance) const { return non_finite == 0 && relative_l2 <= tolerance; }
  std::string describe() const;  // "rel-L2 1.2e-03, max |err| 3.1e-03, mean |err| 4.0e-04"
};

ErrorStats compare(std::span<const bf16> value, std::span<const double> oracle);
ErrorStats compare(std::span<const float> value, std::span<const double> oracle);

// bf16 rounding alone leaves a relative L2 error near 2^-9 / sqrt(3) ≈ 1.1e-3 on each stored
// tensor; two or three rounding points in a row stay well inside this.
inline constexpr double kBf16Tolerance = 1e-2;

}  // namespace mok
