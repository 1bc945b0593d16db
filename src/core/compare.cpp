#include "mok/compare.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "mok/error.hpp"

namespace mok {

namespace {

double as_double(bf16 value) { return static_cast<double>(static_cast<float>(value)); }
double as_double(float value) { return static_cast<double>(value); }
double as_double(double value) { return value; }

template <class T>
ErrorStats compare_impl(std::span<const T> value, std::span<const double> oracle) {
  MOK_CHECK_ARG(value.size() == oracle.size(), "compare", value.size(), " values against ",
                oracle.size(), " oracle values");
  ErrorStats stats;
  stats.count = static_cast<int64_t>(value.size());
  double error_sq = 0, oracle_sq = 0, abs_sum = 0;
  for (size_t index = 0; index < value.size(); ++index) {
    const double actual = as_double(value[index]);
    if (!std::isfinite(actual)) {
      ++stats.non_finite;
      continue;
    }
    const double error = std::fabs(actual - oracle[index]);
    error_sq += error * error;
    oracle_sq += oracle[index] * oracle[index];
    abs_sum += error;
    stats.max_abs = std::max(stats.max_abs, error);
  }
  stats.relative_l2 = oracle_sq > 0 ? std::sqrt(error_sq / oracle_sq) : std::sqrt(error_sq);
  stats.mean_abs = stats.count ? abs_sum / static_cast<double>(stats.count) : 0;
  return stats;
}

}  // namespace

ErrorStats compare(std::span<const bf16> value, std::span<const double> oracle) {
  return compare_impl(value, oracle);
}

ErrorStats compare(std::span<const float> value, std::span<const double> oracle) {
  return compare_impl(value, oracle);
}

ErrorStats compare(std::span<const double> value, std::span<const double> oracle) {
  return compare_impl(value, oracle);
}

std::string ErrorStats::describe() const {
  char text[160];
  std::snprintf(text, sizeof(text), "rel-L2 %.2e, max |err| %.2e, mean |err| %.2e", relative_l2,
                max_abs, mean_abs);
  std::string result = text;
  if (non_finite) result += detail::concat(", ", non_finite, " non-finite");
  return result;
}

double bf16_tolerance(int64_t tokens) {
  return kBf16Tolerance + 0.06 / std::sqrt(static_cast<double>(std::max<int64_t>(tokens, 1)));
}

double fp8_yardstick_margin(int64_t tokens) {
  return kFp8YardstickTolerance +
         0.4 / std::sqrt(static_cast<double>(std::max<int64_t>(tokens, 1)));
}

}  // namespace mok
