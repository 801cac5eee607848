// kvserve's own thread pool for the kernels' parallel_for.
//
// torch's OpenMP pool ends a parallel region only once every thread of its team has run its part,
// so on a small machine a thread that the OS has taken off its vCPU (for another process, the API
// server, a load generator) holds up every kernel call of a step until it runs again. Here a call
// ends when its chunks are done: the calling thread claims every chunk no worker has, and a worker
// that wakes after the call finds none left. Workers spin a short while after a call (the next one
// usually follows within microseconds), then sleep until woken.
//
// A call is published as a ticket (generation, chunk count, next chunk) in one atomic word: a
// chunk is claimed by a compare-exchange that also checks the generation, so a worker late for
// one call can never take a chunk of the next; the call's fields stay valid while any of its
// chunks is unfinished, since the caller waits for all of them.

#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

#include "host.h"

namespace kvserve::host_lib {
namespace {

// How long an idle worker spins before it sleeps: longer than the gaps between a step's kernel
// calls, short enough that an idle server does not hold its cores.
constexpr auto kSpin = std::chrono::microseconds(2000);

inline void relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

constexpr uint64_t pack(uint32_t gen, uint32_t count, uint32_t next) {
  return uint64_t{gen} << 32 | uint64_t{count} << 16 | next;
}

class Pool {
 public:
  explicit Pool(int workers) {
    threads_.reserve(workers);
    for (int i = 0; i < workers; ++i) threads_.emplace_back([this] { work(); });
  }

  ~Pool() {
    {
      std::lock_guard<std::mutex> lock(sleep_mutex_);
      stop_.store(true);
    }
    wake_.notify_all();
    for (auto& t : threads_) t.join();
  }

  int workers() const { return static_cast<int>(threads_.size()); }

  // fn over [begin, end) in `count` chunks of `chunk` items (the last one shorter).
  void run(int64_t begin, int64_t end, int64_t chunk, uint32_t count, void (*body)(void*, int64_t, int64_t),
           void* ctx) {
    body_ = body, ctx_ = ctx, begin_ = begin, end_ = end, chunk_ = chunk;
    error_ = nullptr;
    done_.store(0, std::memory_order_relaxed);
    if (++gen_ == 0) ++gen_;  // 0 means "stop" to a worker: a long-lived server wraps past it
    const uint32_t gen = gen_;
    ticket_.store(pack(gen, count, 0));  // seq_cst: ordered before the sleepers_ load below
    if (sleepers_.load() > 0) {
      { std::lock_guard<std::mutex> lock(sleep_mutex_); }
      wake_.notify_all();
    }
    run_chunks(gen);
    for (uint32_t spins = 1; done_.load(std::memory_order_acquire) < count; ++spins) {
      relax();
      if (spins % 1024 == 0) std::this_thread::yield();  // a worker holding a chunk may share this vCPU
    }
    if (error_) std::rethrow_exception(error_);
  }

 private:
  bool claim(uint32_t gen, uint32_t* index) {
    uint64_t t = ticket_.load(std::memory_order_acquire);
    for (;;) {
      const uint32_t next = t & 0xFFFF, count = (t >> 16) & 0xFFFF;
      if ((t >> 32) != gen || next >= count) return false;
      if (ticket_.compare_exchange_weak(t, t + 1, std::memory_order_acquire, std::memory_order_acquire)) {
        *index = next;
        return true;
      }
    }
  }

  void run_chunks(uint32_t gen) {
    for (uint32_t i; claim(gen, &i);) {
      const int64_t b = begin_ + static_cast<int64_t>(i) * chunk_;
      try {
        body_(ctx_, b, std::min(end_, b + chunk_));
      } catch (...) {
        std::lock_guard<std::mutex> lock(error_mutex_);
        if (!error_) error_ = std::current_exception();
      }
      done_.fetch_add(1, std::memory_order_release);
    }
  }

  // The generation of the next call, or 0 once the pool stops.
  uint32_t wait_for_call(uint32_t seen) {
    const auto deadline = std::chrono::steady_clock::now() + kSpin;
    for (uint32_t spins = 1;; ++spins) {
      const uint32_t gen = ticket_.load(std::memory_order_acquire) >> 32;
      if (gen != seen) return gen;
      if (stop_.load(std::memory_order_relaxed)) return 0;
      relax();
      if (spins % 256 == 0 && std::chrono::steady_clock::now() > deadline) break;
    }
    std::unique_lock<std::mutex> lock(sleep_mutex_);
    sleepers_.fetch_add(1);
    wake_.wait(lock, [&] { return (ticket_.load() >> 32) != seen || stop_.load(); });
    sleepers_.fetch_sub(1);
    return stop_.load() ? 0 : static_cast<uint32_t>(ticket_.load() >> 32);
  }

  void work();

  std::atomic<uint64_t> ticket_{0};
  alignas(64) std::atomic<uint32_t> done_{0};
  alignas(64) std::atomic<int> sleepers_{0};
  std::atomic<bool> stop_{false};
  uint32_t gen_ = 0;
  void (*body_)(void*, int64_t, int64_t) = nullptr;
  void* ctx_ = nullptr;
  int64_t begin_ = 0, end_ = 0, chunk_ = 1;
  std::exception_ptr error_;
  std::mutex error_mutex_, sleep_mutex_;
  std::condition_variable wake_;
  std::vector<std::thread> threads_;
};

thread_local bool inside = false;  // in a call's chunk: a nested parallel_for runs inline

void Pool::work() {
  inside = true;
  for (uint32_t seen = 0;;) {
    const uint32_t gen = wait_for_call(seen);
    if (!gen) return;
    seen = gen;
    run_chunks(gen);
  }
}

// The process's pool (made on first use, remade when the thread count changes) and the lock a call
// holds; both are left behind in a forked child, whose copy has no worker threads.
Pool* pool = nullptr;
std::mutex* calls = new std::mutex;
const bool kForkHandled = (pthread_atfork(nullptr, nullptr, [] { pool = nullptr, calls = new std::mutex; }), true);

}  // namespace

void pool_parallel_for(int threads, int64_t begin, int64_t end, int64_t grain,
                       void (*body)(void*, int64_t, int64_t), void* ctx) {
  const int64_t range = end - begin;
  // at::parallel_for's split: at most one chunk per thread, each at least `grain` items
  const int64_t count = std::min<int64_t>({threads, (range + grain - 1) / std::max<int64_t>(grain, 1), 0xFFFF});
  std::unique_lock<std::mutex> lock(*calls, std::defer_lock);
  if (inside || count <= 1 || !lock.try_lock()) {  // nested, too small, or another thread's call running
    body(ctx, begin, end);
    return;
  }
  if (!pool || pool->workers() != threads - 1) {
    delete pool;
    pool = new Pool(threads - 1);
  }
  const int64_t chunk = (range + count - 1) / count;
  inside = true;
  try {
    pool->run(begin, end, chunk, static_cast<uint32_t>((range + chunk - 1) / chunk), body, ctx);
  } catch (...) {
    inside = false;
    throw;
  }
  inside = false;
}

}  // namespace kvserve::host_lib
