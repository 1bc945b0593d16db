// The GPU tests' device allocations: mok::DeviceBuffer (mok/device_buffer.hpp).
#pragma once

#include "mok/device_buffer.hpp"

namespace mok::testing {

using ::mok::DeviceBuffer;

}  // namespace mok::testing
