// device_fingerprint (runtime/device_memory.hpp), which bench_layer and `mok run` use to compare
// two backwards' outputs without copying them to the host: equal bytes give equal fingerprints
// whatever the grid's summation order, and one flipped bit anywhere (a tail byte included) or two
// words swapped give another.
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <vector>

#include "layer_test_support.cuh"
#include "runtime/device_memory.hpp"

namespace mok::comm_test {
namespace {

TEST(DeviceFingerprint, EqualBytesMatchAndAnyChangeShows) {
  MOK_REQUIRE_HOPPER_GPUS(1);
  std::mt19937_64 random(7);
  for (size_t bytes : {size_t{1}, size_t{13}, size_t{4096}, size_t{1000003}}) {
    SCOPED_TRACE(bytes);
    std::vector<uint8_t> host(bytes);
    for (uint8_t& byte : host) byte = static_cast<uint8_t>(random());
    DeviceBuffer<uint8_t> a(host), b(host);
    const auto print = [](const DeviceBuffer<uint8_t>& buffer) {
      return device_fingerprint(buffer.get(), static_cast<int64_t>(buffer.bytes()), nullptr);
    };
    const uint64_t first = print(a);
    EXPECT_EQ(print(a), first) << "the same bytes twice";
    EXPECT_EQ(print(b), first) << "a copy";
    for (size_t position : {size_t{0}, bytes / 2, bytes - 1}) {
      std::vector<uint8_t> flipped = host;
      flipped[position] ^= 0x10;
      b.upload(flipped);
      EXPECT_NE(print(b), first) << "bit 4 of byte " << position << " flipped";
    }
    if (bytes >= 16) {  // two whole words swapped: the same bytes in another place
      std::vector<uint8_t> swapped = host;
      for (size_t byte = 0; byte < 8; ++byte) std::swap(swapped[byte], swapped[8 + byte]);
      if (swapped != host) {
        b.upload(swapped);
        EXPECT_NE(print(b), first) << "words 0 and 1 swapped";
      }
    }
  }
}

}  // namespace
}  // namespace mok::comm_test
