// Work splitting shared by the native kernels (XLA FFI calls on the CPU).
#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>

#include "xla/ffi/api/ffi.h"

namespace ba_native {

// Calls fn(i) once for every i in [0, n), on the calling thread and up to (pool threads)
// helpers, handing the units out from an atomic counter; returns when all have finished.
// The caller only waits for units already claimed, so a busy pool cannot deadlock the
// call, and a helper that starts late finds nothing left. Each helper holds a copy of fn:
// what the units need must stay alive through fn's captures.
template <typename F>
void ParallelFor(xla::ffi::ThreadPool& pool, int64_t n, F fn) {
  if (n <= 0) return;
  struct State {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
    std::mutex mu;
    std::condition_variable cv;
  };
  auto state = std::make_shared<State>();
  auto work = [state, n, fn]() {
    for (;;) {
      const int64_t i = state->next.fetch_add(1);
      if (i >= n) return;
      fn(i);
      if (state->done.fetch_add(1) + 1 == n) {
        std::lock_guard<std::mutex> lock(state->mu);
        state->cv.notify_all();
      }
    }
  };
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), n - 1);
  for (int64_t t = 0; t < helpers; ++t) pool.Schedule([work]() { work(); });
  work();
  std::unique_lock<std::mutex> lock(state->mu);
  state->cv.wait(lock, [&] { return state->done.load() == n; });
}

}  // namespace ba_native
