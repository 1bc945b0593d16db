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
// An fp64 result against the oracle: e.g. the FP8 yardstick (reference::oracle with a precision).
ErrorStats compare(std::span<const double> value, std::span<const double> oracle);

// bf16 rounding alone leaves a relative L2 error near 2^-9 / sqrt(3) ≈ 1.1e-3 on each stored
// tensor; two or three rounding points in a row stay well inside this.
inline constexpr double kBf16Tolerance = 1e-2;

// In an FP8 mode the quantization dominates (a few percent): an output passes when its error
// against the fp64 oracle is within this fraction of the yardstick's (the same quantized operands,
// everything else in fp64: reference::oracle with the precision). The bf16 stores the emulation
// adds move it by well under 1 %; a quantization point skipped, added or scaled wrongly moves it
// by a quarter or more (tests/cpu/test_reference_fp8.cpp derives both).
inline constexpr double kFp8YardstickTolerance = 0.05;

// The two rules above are statistical: they hold for errors over many tokens' values (the tests
// apply them from 256 tokens up). On a few tokens an output's error is that of a handful of
// values — some of them sums that nearly cancel, or E4M3 codes that one bf16 rounding moved to a
// neighbour — and scatters further. The CLI's --check, which runs any shape the user gives, allows
// a run of T tokens (over all ranks) 1 / sqrt(T) times a fixed amount more:
//   bf16        rel-L2 <= kBf16Tolerance + 0.06 / sqrt(T)
//   FP8 modes   |rel-L2 - yardstick| <= (kFp8YardstickTolerance + 0.4 / sqrt(T)) · yardstick,
//               judged only from kFp8JudgedTokens tokens on: below, the scatter passes the quarter
//               of the yardstick that a quantization point skipped, added or scaled wrongly moves
//               an error by, so nothing could be told apart.
// tests/cpu/test_check_bounds.cpp measures them on random small layers.
inline constexpr int64_t kFp8JudgedTokens = 16;
double bf16_tolerance(int64_t tokens);
double fp8_yardstick_margin(int64_t tokens);

}  // namespace mok
