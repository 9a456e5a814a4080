// Work split over the caller and XLA's intra-op thread pool, shared by the decode kernels (matvec.cc,
// decode_attention.cc).
//
// A decode step is ~150 kernel calls of 50-300 us each, a few microseconds apart. A helper scheduled into XLA's pool
// for each call starts 20-50 us late (its thread was asleep), a fifth of a small product, during which the caller
// works alone. So a helper that finishes a call's items does not return to the pool at once: it polls for the next
// call's items for up to kLingerNs and takes them as soon as they are posted, and returns to the pool only when no
// call came in that time (between decode steps, or when the process does something else). At most
// `pool.num_threads() - 1` helpers linger, together with the caller one busy thread per pool thread.
//
// The helpers are process-wide: `helpers()` is an inline function's static object in a named namespace, which the
// compiler marks unique (STB_GNU_UNIQUE) and the loader binds to one copy for every library that has it, and
// native.py loads the libraries with RTLD_GLOBAL besides; `causal_lm_parallel_state` lets a test check that two
// libraries share it. (Were they not shared, each library's helpers would linger through the other's calls and
// compete with them for the cores.)
//
// Correctness never depends on the helpers: the caller takes items too and waits only for items already running, so
// a call completes when no helper comes (a busy pool, a caller that is itself a pool thread), and which thread runs
// an item changes no value.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <thread>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define CLM_PAUSE() _mm_pause()
#else
#define CLM_PAUSE() std::this_thread::yield()
#endif

#include "xla/ffi/api/ffi.h"

namespace causal_lm_native {

constexpr int64_t kLingerNs = 200000;  // 0.2 ms: longer than any gap inside a decode step, shorter than a step

// Items 0..n-1 of one call: fn(ctx, i) each.
struct Job {
  std::atomic<int64_t> next{0}, done{0};
  int64_t n = 0;
  void (*fn)(const void*, int64_t) = nullptr;
  const void* ctx = nullptr;

  void run() {
    for (int64_t i; (i = next.fetch_add(1)) < n;) {
      fn(ctx, i);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

struct Helpers {
  std::atomic<uint64_t> posted{0};  // how many jobs were posted (a helper polls this)
  std::atomic<int64_t> lingering{0};
  std::atomic<bool> locked{false};  // guards `job` (held for a pointer copy)
  std::shared_ptr<Job> job;         // the latest posted job

  void lock() {
    while (locked.exchange(true, std::memory_order_acquire)) CLM_PAUSE();
  }
  void unlock() { locked.store(false, std::memory_order_release); }
};

inline Helpers& helpers() {
  static Helpers h;
  return h;
}

inline int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// A helper's life in the pool: run each posted job's items, poll while jobs keep coming, leave after kLingerNs idle.
inline void linger() {
  Helpers& h = helpers();
  uint64_t seen = 0;
  int64_t idle_since = now_ns();
  for (;;) {
    const uint64_t posted = h.posted.load(std::memory_order_acquire);
    if (posted != seen) {
      seen = posted;
      h.lock();
      std::shared_ptr<Job> job = h.job;
      h.unlock();
      if (job) job->run();
      idle_since = now_ns();
      continue;
    }
    for (int i = 0; i < 32; ++i) CLM_PAUSE();
    if (now_ns() - idle_since > kLingerNs) {
      h.lingering.fetch_sub(1);
      if (h.posted.load(std::memory_order_acquire) == seen) return;
      // A job came as it left: stay if no other helper took its place.
      int64_t n = h.lingering.load();
      if (n >= 1 || !h.lingering.compare_exchange_strong(n, n + 1)) return;
      idle_since = now_ns();
    }
  }
}

// Runs fn(i) for i in 0..n-1 on the caller and up to pool.num_threads() - 1 helpers; returns when all are done.
template <typename F>
void parallel_for(int64_t n, xla::ffi::ThreadPool& pool, const F& fn) {
  auto job = std::make_shared<Job>();
  job->n = n;
  job->ctx = &fn;
  job->fn = [](const void* ctx, int64_t i) { (*static_cast<const F*>(ctx))(i); };
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  if (n > 1 && threads > 1) {
    Helpers& h = helpers();
    h.lock();
    h.job = job;
    h.unlock();
    h.posted.fetch_add(1, std::memory_order_release);
    const int64_t want = std::min<int64_t>(threads, n) - 1;
    for (int64_t a = h.lingering.load(); a < want; a = h.lingering.load())
      if (h.lingering.compare_exchange_weak(a, a + 1)) pool.Schedule([] { linger(); });
  }
  job->run();
  while (job->done.load(std::memory_order_acquire) < n) std::this_thread::yield();
}

}  // namespace causal_lm_native

// The address of this library's helper state (a test checks that every kernel library shares one).
#define CLM_PARALLEL_STATE_SYMBOL                                                 \
  extern "C" __attribute__((visibility("default"))) void* causal_lm_parallel_state() { \
    return &causal_lm_native::helpers();                                          \
  }
