// A small worker pool for row-parallel kernels. The calling thread always works too, and work is handed out as
// claimable chunks (one atomic ticket), so a helper that is descheduled because its core is busy only delays the
// chunk it already holds; nothing waits at a barrier for a helper that has not started.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace mlxchat {

class Pool {
 public:
  explicit Pool(int helpers);
  ~Pool();
  Pool(const Pool&) = delete;
  Pool& operator=(const Pool&) = delete;

  int threads() const { return int(workers_.size()) + 1; }
  // Runs fn(0) .. fn(chunks - 1), each exactly once, and returns when all have finished. Helpers keep polling for
  // `linger` after it before they sleep: for a caller that runs many jobs back to back (a fused layer's matmuls),
  // where waking a sleeping helper for each job cost more than the job saved. Zero for jobs whose gaps belong to
  // another thread (a graph of small ops that Python builds on the other core: a polling helper took that core).
  void run(int chunks, const std::function<void(int)>& fn, std::chrono::microseconds linger);

 private:
  void work(uint64_t generation);
  void helper_loop();

  std::vector<std::thread> workers_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::atomic<uint64_t> generation_{0};
  // High 32 bits: the job's generation; low 32 bits: the next chunk to claim. A helper that wakes late for a
  // finished job sees another generation and claims nothing.
  std::atomic<uint64_t> ticket_{0};
  std::atomic<int> done_{0};
  std::atomic<int> sleepers_{0};
  std::atomic<int> chunks_{0};
  std::atomic<int> linger_us_{0};
  std::atomic<const std::function<void(int)>*> fn_{nullptr};
  bool stop_ = false;
};

}  // namespace mlxchat
