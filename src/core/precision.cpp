#include "mok/precision.hpp"

#include "mok/error.hpp"

namespace mok {

std::string_view precision_name(Precision precision) {
  switch (precision) {
    case Precision::kBf16:
      return "bf16";
    case Precision::kFp8:
      return "fp8";
    case Precision::kMxfp8:
      return "mxfp8";
  }
  return "unknown";
}

Precision parse_precision(std::string_view text) {
  for (Precision precision : {Precision::kBf16, Precision::kFp8, Precision::kMxfp8}) {
    if (text == precision_name(precision)) return precision;
  }
  MOK_CHECK_ARG(false, "precision", "unknown precision '", text, "' (bf16, fp8, mxfp8)");
  return Precision::kBf16;
}

int64_t precision_block(Precision precision) {
  switch (precision) {
    case Precision::kFp8:
      return 128;
    case Precision::kMxfp8:
      return 32;
    default:
      return 0;
  }
}

void validate_precision(const LayerShape& shape, Precision precision) {
  const int64_t block = precision_block(precision);
  MOK_CHECK_ARG(precision == Precision::kBf16 || block > 0, "precision", "unknown precision ",
                static_cast<int32_t>(precision));
  if (block == 0) return;
  MOK_CHECK_ARG(shape.hidden % block == 0, "hidden", precision_name(precision),
                " needs a multiple of ", block, ", got ", shape.hidden);
  MOK_CHECK_ARG(shape.intermediate % block == 0, "intermediate", precision_name(precision),
                " needs a multiple of ", block, ", got ", shape.intermediate);
  MOK_CHECK_ARG(shape.shared_intermediate % block == 0, "shared_intermediate",
                precision_name(precision), " needs a multiple of ", block, ", got ",
                shape.shared_intermediate);
}

}  // namespace mok
