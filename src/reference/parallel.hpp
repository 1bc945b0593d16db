// A minimal parallel loop for the CPU backend. Items are independent: each output element is
// computed by exactly one item with a fixed order of operations, so results never depend on the
// number of threads or on which thread takes which item.
#pragma once

#include <cstdint>
#include <functional>
#include <string_view>

namespace mok::reference {

using ProgressFn = std::function<void(std::string_view phase, int64_t done, int64_t total)>;

int resolve_num_threads(int requested);

// Calls body(item, thread_idx) for every item in [0, num_items); thread_idx < num_threads indexes
// per-thread scratch. `progress`, when set, is called from thread 0 as items complete.
void parallel_for(int64_t num_items, int num_threads,
                  const std::function<void(int64_t item, int thread_idx)>& body,
                  std::string_view phase = {}, const ProgressFn& progress = {});

}  // namespace mok::reference
