#include "reference/parallel.hpp"

#include <atomic>
#include <chrono>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

namespace mok::reference {

int resolve_num_threads(int requested) {
  if (requested > 0) return requested;
  const unsigned hardware = std::thread::hardware_concurrency();
  return hardware > 0 ? static_cast<int>(hardware) : 1;
}

void parallel_for(int64_t num_items, int num_threads, const std::function<void(int64_t, int)>& body,
                  std::string_view phase, const ProgressFn& progress) {
  if (num_items <= 0) return;
  num_threads = static_cast<int>(std::min<int64_t>(resolve_num_threads(num_threads), num_items));
  std::atomic<int64_t> next_item{0};
  std::atomic<int64_t> done_items{0};
  std::exception_ptr failure;
  std::mutex failure_mutex;

  auto worker = [&](int thread_idx) {
    auto last_report = std::chrono::steady_clock::now();
    try {
      for (int64_t item = next_item++; item < num_items; item = next_item++) {
        body(item, thread_idx);
        const int64_t done = ++done_items;
        if (thread_idx == 0 && progress) {
          const auto now = std::chrono::steady_clock::now();
          if (now - last_report > std::chrono::milliseconds(500)) {
            progress(phase, done, num_items);
            last_report = now;
          }
        }
      }
    } catch (...) {
      std::lock_guard<std::mutex> lock(failure_mutex);
      if (!failure) failure = std::current_exception();
      next_item = num_items;  // stop handing out work
    }
  };

  std::vector<std::thread> helpers;
  for (int thread_idx = 1; thread_idx < num_threads; ++thread_idx) {
    helpers.emplace_back(worker, thread_idx);
  }
  worker(0);
  for (std::thread& helper : helpers) helper.join();
  if (failure) std::rethrow_exception(failure);
  if (progress) progress(phase, num_items, num_items);
}

}  // namespace mok::reference
