// Host-side checks of the GEMM API (no GPU needed, run in CI): the fused gate/up weight layout the
// SwiGLU GEMM reads (rows 16b..16b+7 are gate rows 8b..8b+7, rows 16b+8..16b+15 the matching up
// rows), and the launchers' refusal of outputs they cannot write.
#include <gtest/gtest.h>

#include <string>
#include <utility>
#include <vector>

#include "mok/error.hpp"
#include "mok/gemm.hpp"

namespace mok::gemm {
namespace {

TEST(GateUpLayout, InterleavesBlocksOfEightRowsPerExpert) {
  constexpr int kExperts = 3, kIntermediate = 24, kHidden = 16;
  std::vector<bf16> gate(kExperts * kIntermediate * kHidden), up(gate.size());
  for (size_t index = 0; index < gate.size(); ++index) {  // every element a distinct bit pattern
    gate[index] = bf16::from_bits(static_cast<uint16_t>(index));
    up[index] = bf16::from_bits(static_cast<uint16_t>(0x8000u | index));
  }
  const std::vector<bf16> fused = interleave_gate_up(gate, up, kExperts, kIntermediate, kHidden);
  ASSERT_EQ(fused.size(), 2 * gate.size());
  for (int expert = 0; expert < kExperts; ++expert) {
    for (int row = 0; row < 2 * kIntermediate; ++row) {
      const int block = row / 16, within = row % 16;
      const bool is_up = within >= 8;
      const int source_row = block * 8 + within % 8;
      const std::vector<bf16>& source = is_up ? up : gate;
      for (int column = 0; column < kHidden; ++column) {
        const size_t fused_index =
            (static_cast<size_t>(expert) * 2 * kIntermediate + row) * kHidden + column;
        const size_t source_index =
            (static_cast<size_t>(expert) * kIntermediate + source_row) * kHidden + column;
        ASSERT_EQ(fused[fused_index].bits, source[source_index].bits)
            << "expert " << expert << ", fused row " << row << ", column " << column;
      }
    }
  }
}

// Runs `call` and checks it throws the mok::Error of the output check: about `argument`, with
// `fragment` in the message. Any other error (without a GPU, the first CUDA call's "cuda" one)
// fails, so the test cannot pass by accident once the check is gone.
template <class Call>
void expect_output_refused(Call call, const std::string& argument, const std::string& fragment) {
  try {
    call();
    ADD_FAILURE() << argument << ": no error; expected one with '" << fragment << "'";
  } catch (const Error& error) {
    EXPECT_EQ(error.argument(), argument) << error.what();
    EXPECT_NE(std::string(error.what()).find(fragment), std::string::npos)
        << "message '" << error.what() << "' lacks '" << fragment << "'";
  }
}

// The launchers refuse an output they cannot store to 16 bytes at a time, before they touch the GPU
// (so this runs without one; the other pointers are never read).
TEST(GemmArguments, RefuseANullOrMisalignedOutput) {
  alignas(16) static char buffer[256];
  const auto* data = reinterpret_cast<const bf16*>(buffer);
  const int offsets[2] = {0, 1};
  const GroupedShape shape{1, 8, 16, 16};
  const std::pair<char*, std::string> cases[] = {{nullptr, "is null"},
                                                 {buffer + 8, "must be 16-byte aligned"}};
  for (const auto& [output, fragment] : cases) {
    SCOPED_TRACE(fragment);
    expect_output_refused(
        [&] { grouped_forward(shape, data, data, offsets, output, ForwardOutput::kBf16, nullptr); },
        "y", fragment);
    expect_output_refused(
        [&] {
          grouped_dgrad(shape, data, data, offsets, reinterpret_cast<bf16*>(output), nullptr);
        },
        "dx", fragment);
    expect_output_refused(
        [&] { grouped_wgrad(shape, data, data, offsets, output, WgradOutput::kFp32, nullptr); },
        "dw", fragment);
  }
}

}  // namespace
}  // namespace mok::gemm
