// The layer's precision modes (DESIGN.md §3): which operands the expert GEMMs read and how they are
// scaled. The quantization points of the two FP8 modes are listed in docs/quantize.md.
#pragma once

#include <cstdint>
#include <string_view>

#include "mok/shape.hpp"

namespace mok {

enum class Precision : int32_t {
  kBf16 = 0,   // bf16 operands, fp32 accumulation
  kFp8 = 1,    // E4M3, fp32 scales: activations 1 x 128, weights 128 x 128 (DeepSeek-V3)
  kMxfp8 = 2,  // E4M3, E8M0 scales per 1 x 32 (OCP MX)
};

// "bf16", "fp8", "mxfp8".
std::string_view precision_name(Precision precision);

// The inverse of precision_name; throws mok::Error("precision", ...) listing the known names.
Precision parse_precision(std::string_view text);

// The length of a quantization block along K in an FP8 mode (128 or 32); 0 for kBf16.
int64_t precision_block(Precision precision);

// Throws mok::Error naming the field unless every GEMM's K (H, I, I_s) and hence every block a
// mode quantizes is a whole number of its blocks; kBf16 accepts every valid shape.
void validate_precision(const LayerShape& shape, Precision precision);

}  // namespace mok
