#include "pool.h"

#include <chrono>

namespace mlxchat {

namespace {
inline void relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#else
  std::this_thread::yield();
#endif
}
}  // namespace

Pool::Pool(int helpers) {
  for (int i = 0; i < helpers; ++i) workers_.emplace_back([this] { helper_loop(); });
}

Pool::~Pool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
    generation_.fetch_add(1);
  }
  cv_.notify_all();
  for (auto& t : workers_) t.join();
}

void Pool::work(uint64_t generation) {
  uint64_t t = ticket_.load(std::memory_order_acquire);
  for (;;) {
    if ((t >> 32) != (generation & 0xffffffffu) || int(t & 0xffffffffu) >= chunks_.load(std::memory_order_relaxed)) return;
    if (!ticket_.compare_exchange_weak(t, t + 1, std::memory_order_acq_rel)) continue;
    (*fn_.load(std::memory_order_relaxed))(int(t & 0xffffffffu));
    done_.fetch_add(1, std::memory_order_release);
    t = ticket_.load(std::memory_order_acquire);
  }
}

void Pool::run(int chunks, const std::function<void(int)>& fn, std::chrono::microseconds linger) {
  if (workers_.empty() || chunks <= 1) {
    for (int c = 0; c < chunks; ++c) fn(c);
    return;
  }
  uint64_t generation;
  {
    // Under the lock so a helper that reads the job (fn_, chunks_) sees a consistent one.
    std::lock_guard<std::mutex> lock(mu_);
    fn_.store(&fn, std::memory_order_relaxed);
    chunks_.store(chunks, std::memory_order_relaxed);
    done_.store(0, std::memory_order_relaxed);
    linger_us_.store(int(linger.count()), std::memory_order_relaxed);
    generation = generation_.load(std::memory_order_relaxed) + 1;
    ticket_.store((generation & 0xffffffffu) << 32, std::memory_order_release);
    generation_.store(generation, std::memory_order_seq_cst);
  }
  if (sleepers_.load(std::memory_order_seq_cst) > 0) cv_.notify_all();
  work(generation);
  // Only chunks already claimed by a helper remain: wait for those, never for a helper to start.
  while (done_.load(std::memory_order_acquire) < chunks) relax();
}

void Pool::helper_loop() {
  uint64_t seen = 0;
  for (;;) {
    const auto linger = std::chrono::microseconds(linger_us_.load(std::memory_order_relaxed));
    const auto deadline = std::chrono::steady_clock::now() + linger;
    uint64_t g = generation_.load(std::memory_order_acquire);
    int polls = 0;
    while (g == seen) {
      relax();
      if (++polls % 64 == 0 && std::chrono::steady_clock::now() > deadline) {
        std::unique_lock<std::mutex> lock(mu_);
        sleepers_.fetch_add(1, std::memory_order_seq_cst);
        cv_.wait(lock, [&] { return generation_.load(std::memory_order_seq_cst) != seen; });
        sleepers_.fetch_sub(1, std::memory_order_relaxed);
      }
      g = generation_.load(std::memory_order_acquire);
    }
    seen = g;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stop_) return;
      g = generation_.load(std::memory_order_relaxed);
      seen = g;
    }
    work(g);
  }
}

}  // namespace mlxchat
