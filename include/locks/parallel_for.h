// OpenMP loops whose body may throw. An exception must not leave an OpenMP region (the runtime calls
// std::terminate, which ends the process without the CLI's error message), so the first exception is
// carried out of the loop and rethrown after it.
#pragma once

#include <atomic>
#include <exception>
#include <mutex>

namespace locks {

/// Runs body(i) for i in [0, n): on OpenMP threads when n >= min_parallel, else on the calling
/// thread; schedule(static) for dynamic_chunk 0, else schedule(dynamic, dynamic_chunk). The first
/// exception a body throws is rethrown once the loop is over; iterations not yet started by then are
/// skipped.
template <class Body>
void parallel_for(int n, Body&& body, int min_parallel = 2, int dynamic_chunk = 0) {
  std::exception_ptr error;
  std::mutex error_mutex;
  std::atomic<bool> failed{false};
  auto run = [&](int i) {
    if (failed.load(std::memory_order_relaxed)) return;
    try {
      body(i);
    } catch (...) {
      const std::lock_guard<std::mutex> lock(error_mutex);
      if (!error) error = std::current_exception();
      failed.store(true, std::memory_order_relaxed);
    }
  };
  const bool parallel = n >= min_parallel;
  if (dynamic_chunk > 0) {
#pragma omp parallel for schedule(dynamic, dynamic_chunk) if (parallel)
    for (int i = 0; i < n; ++i) run(i);
  } else {
#pragma omp parallel for schedule(static) if (parallel)
    for (int i = 0; i < n; ++i) run(i);
  }
  if (error) std::rethrow_exception(error);
}

}  // namespace locks
