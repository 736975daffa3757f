// Parallel loops over XLA's intra-op thread pool (the FFI execution context's
// ThreadPool). XLA may run scheduled tasks later, on fewer threads, or on the
// calling thread, so the caller works too and helpers that start after all
// tasks are claimed exit at once: the loop never waits on a task that is not
// already running, and it spins briefly before it sleeps on one that is.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <limits>
#include <memory>
#include <mutex>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace qmoe::cpu {

// How long the caller of ParallelFor spins for helpers to finish before it sleeps.
inline constexpr std::chrono::microseconds kSpinWait{200};

inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#else
  std::this_thread::yield();
#endif
}

// Threads a loop may use: XLA's pool plus the caller (at least 1).
inline int64_t Workers(xla::ffi::ThreadPool& pool) {
  return std::max<int64_t>(1, pool.num_threads());
}

// Runs body(task) for every task in [0, tasks) and returns when all are done.
template <typename Body>
void ParallelFor(xla::ffi::ThreadPool& pool, int64_t tasks, const Body& body) {
  if (tasks <= 0) return;
  struct Loop {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> finished{0};
    int64_t tasks = 0;
    const Body* body = nullptr;  // valid while finished < tasks
    std::mutex mutex;
    std::condition_variable all_finished;

    void Work() {
      int64_t done = 0;
      for (int64_t task; (task = next.fetch_add(1)) < tasks; ++done) (*body)(task);
      if (done > 0 && finished.fetch_add(done) + done == tasks) {
        std::lock_guard<std::mutex> lock(mutex);
        all_finished.notify_all();
      }
    }
  };
  auto loop = std::make_shared<Loop>();
  loop->tasks = tasks;
  loop->body = &body;
  const int64_t helpers = std::min(tasks, Workers(pool)) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([loop] { loop->Work(); });
  loop->Work();
  // Every task is claimed now; helpers still on one finish within a task's
  // time. Wait for them spinning first (up to kSpinWait): sleeping and being
  // woken costs tens of microseconds on a virtual machine, as much as a
  // small matrix's whole product (docs/cpu_kernels.md §2; the measurement
  // is in docs/measurements.md, kernels_cpu.py).
  const auto spin_until = std::chrono::steady_clock::now() + kSpinWait;
  while (loop->finished.load() != tasks && std::chrono::steady_clock::now() < spin_until) {
    for (int i = 0; i < 64; ++i) CpuRelax();
  }
  std::unique_lock<std::mutex> lock(loop->mutex);
  loop->all_finished.wait(lock, [&] { return loop->finished.load() == tasks; });
}

// Records the smallest failing index among concurrent tasks.
class FirstFailure {
 public:
  void Record(int64_t index) {
    int64_t current = first_.load();
    while (index < current && !first_.compare_exchange_weak(current, index)) {
    }
  }
  bool failed() const { return first_.load() != kNone; }
  int64_t index() const { return first_.load(); }

 private:
  static constexpr int64_t kNone = std::numeric_limits<int64_t>::max();
  std::atomic<int64_t> first_{kNone};
};

}  // namespace qmoe::cpu
