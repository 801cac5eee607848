// Shared by every kernel set (no torch headers, no ISA intrinsics): the host's thread pool,
// scalar bf16 conversions, paged-cache row lookup, work splitting.
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "kernels.h"

namespace kvserve {

// The host of the loaded set (set once by the set's entry point, before any kernel runs).
inline const Host*& host() {
  static const Host* h = nullptr;
  return h;
}

inline int num_threads() { return host()->num_threads(); }

// fn(begin, end) over chunks of [begin, end) on the host's threads (at::parallel_for's contract:
// chunks of at least `grain` items, the calling thread takes part).
template <typename Fn>
inline void parallel_for(int64_t begin, int64_t end, int64_t grain, const Fn& fn) {
  if (begin >= end) return;
  host()->parallel_for(
      begin, end, grain,
      [](void* ctx, int64_t b, int64_t e) { (*static_cast<const Fn*>(ctx))(b, e); },
      const_cast<void*>(static_cast<const void*>(&fn)));
}

// Items [0, n) shared out at run time. Each thread starts on its own contiguous share (as
// parallel_for's static split) and, once that is done, takes items from the back of the share
// with the most left: a thread that the machine slows (another process, a hypervisor taking the
// vCPU) no longer holds the others at the end of the call. Which thread runs an item never
// changes its result. fn(ItemQueue& q) runs once per thread: `for (int64_t i; q.next(&i);)`.
class ItemQueue {
 public:
  // Claims the next item: the own share's front, else another share's back; false when none left.
  bool next(int64_t* item) {
    if (take(self_, false, item)) return true;
    for (;;) {
      int victim = -1;
      int64_t most = 0;
      for (int t = 0; t < count_; ++t) {
        const uint64_t r = shares_[t].range.load(std::memory_order_relaxed);
        const int64_t left = static_cast<int64_t>(r >> 32) - static_cast<int64_t>(r & 0xFFFFFFFFu);
        if (left > most) most = left, victim = t;
      }
      if (victim < 0) return false;
      if (take(victim, true, item)) return true;
    }
  }

 private:
  template <typename Fn>
  friend void parallel_items(int64_t n, const Fn& fn);
  struct alignas(64) Share {
    std::atomic<uint64_t> range;  // lo | hi << 32: the items [lo, hi) still to run
  };
  ItemQueue(Share* shares, int count, int self, int64_t base)
      : shares_(shares), count_(count), self_(self), base_(base) {}

  bool take(int t, bool back, int64_t* item) {
    uint64_t r = shares_[t].range.load(std::memory_order_relaxed);
    for (;;) {
      const uint64_t lo = r & 0xFFFFFFFFu, hi = r >> 32;
      if (lo >= hi) return false;
      const uint64_t taken = back ? lo | (hi - 1) << 32 : (lo + 1) | hi << 32;
      if (shares_[t].range.compare_exchange_weak(r, taken, std::memory_order_relaxed)) {
        *item = base_ + static_cast<int64_t>(back ? hi - 1 : lo);
        return true;
      }
    }
  }

  Share* shares_;
  int count_, self_;
  int64_t base_;
};

template <typename Fn>
inline void parallel_items(int64_t n, const Fn& fn) {
  if (n <= 0) return;
  const int count = static_cast<int>(std::min<int64_t>(num_threads(), n));
  std::vector<ItemQueue::Share> shares(std::max(count, 1));
  if (count <= 1 || n >= (int64_t{1} << 32)) {  // one thread (or too many items to pack): in order
    for (int64_t b = 0; b < n; b += int64_t{1} << 31) {
      shares[0].range.store(static_cast<uint64_t>(std::min(n - b, int64_t{1} << 31)) << 32);
      ItemQueue q(shares.data(), 1, 0, b);
      fn(q);
    }
    return;
  }
  for (int t = 0; t < count; ++t)
    shares[t].range.store(static_cast<uint64_t>(n * t / count) | static_cast<uint64_t>(n * (t + 1) / count) << 32);
  // A nested call runs inline: one thread then takes every share in turn.
  parallel_for(0, count, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      ItemQueue q(shares.data(), count, static_cast<int>(t), 0);
      fn(q);
    }
  });
}

inline float bf16_to_float(uint16_t v) {
  const uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// Round to nearest even, NaN kept quiet (c10::BFloat16's conversion).
inline uint16_t float_to_bf16(float f) {
  if (std::isnan(f)) return 0x7FC0;
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  return static_cast<uint16_t>((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);
}

inline float fp16_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1F, mant = h & 0x3FF, bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: normalize
      exp = 127 - 15 + 1;
      while (!(mant & 0x400)) mant <<= 1, --exp;
      bits = sign | (exp << 23) | ((mant & 0x3FF) << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7F800000 | (mant << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// An element of a row of logits as fp32 (bf16 widened exactly).
inline float value_at(const float* x, int64_t i) { return x[i]; }
inline float value_at(const uint16_t* x, int64_t i) { return bf16_to_float(x[i]); }

// kernels.h's logprobs_topk over rows, given a set's row function
// row(const T* x_row, v, k, float* log_norm, float* top_vals, int64_t* top_ids) for T = uint16_t
// (bf16) and float: it finds the row's log-normalizer and its k largest values.
template <typename RowFn>
void logprobs_topk_rows(const void* x, bool x_bf16, int64_t ld, int64_t rows, int64_t v, const int64_t* tok, int64_t k,
                        float* sp, float* tv, int64_t* ti, const RowFn& row_fn) {
  auto run = [&](const auto* base) {
    parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const auto* row = base + r * ld;
        float norm;
        row_fn(row, v, k, &norm, tv + r * k, ti + r * k);
        sp[r] = value_at(row, tok[r]) - norm;
        for (int64_t j = 0; j < k; ++j) tv[r * k + j] -= norm;
      }
    });
  };
  if (x_bf16)
    run(static_cast<const uint16_t*>(x));
  else
    run(static_cast<const float*>(x));
}

// Where cached tokens t0 .. t0 + n - 1 (all KV heads) sit in a K or V cache.
inline void token_rows(const uint16_t* cache, const int64_t* table, int64_t block_size, int64_t stride_block,
                       int64_t stride_token, int64_t t0, int n, const uint16_t** rows) {
  int64_t block = t0 / block_size, off = t0 % block_size;
  const uint16_t* base = cache + table[block] * stride_block;
  for (int i = 0; i < n; ++i) {
    rows[i] = base + off * stride_token;
    if (++off == block_size && i + 1 < n) {
      off = 0;
      base = cache + table[++block] * stride_block;
    }
  }
}

// Rows per work item of a linear split into (block of rows, column block) items: block_m, or
// fewer (a multiple of tile_m) when there are too few column items to keep every thread busy.
inline int64_t linear_rows_per_item(int64_t m, int64_t col_items, int64_t tile_m, int64_t block_m) {
  const int64_t want_items = 8 * num_threads();
  if (col_items >= want_items) return block_m;
  const int64_t parts = (want_items + col_items - 1) / col_items;
  return std::clamp<int64_t>((m / parts + tile_m - 1) / tile_m * tile_m, tile_m, block_m);
}

// Logit soft-capping (DecodeArgs::softcap) of n scores that the kernel scales by `scale` next:
// s -> cap * tanh(s * scale / cap) / scale, so the scaled score is cap * tanh(scaled / cap) (scale
// 1: scores already scaled). Scalar: only soft-capped models (Gemma 2) pay for it.
inline void softcap_scores(float* s, int64_t n, float scale, float cap) {
  const float to = scale / cap, back = cap / scale;
  for (int64_t i = 0; i < n; ++i) s[i] = back * std::tanh(s[i] * to);
}

// Software prefetch of up to 16 token rows into L2 (decode attention), issued a few lines at a
// time between the compute that precedes their use. Cached blocks are scattered 2-6 KB runs that the
// hardware prefetchers barely follow: without this the cold kernel waited for DRAM and
// then computed (time = read + compute); spread like this the reads overlap the compute
// (benchmarks/bench_kernels.py measures it). Bursts of prefetches did not help:
// they fill the miss buffers and stall the core just as the loads would.
struct RowPrefetcher {
  const char* rows[16];
  int n_rows = 0, lines_per_row = 0, row = 0, line = 0;

  void start(const uint16_t* const* token_rows, int n, int64_t head_off, int64_t row_bytes) {
    for (int i = 0; i < n; ++i) rows[i] = reinterpret_cast<const char*>(token_rows[i] + head_off);
    n_rows = n, lines_per_row = (int)((row_bytes + 63) / 64), row = 0, line = 0;
  }
  // The rows of KV heads [h0, h1) of cached tokens [t0, min(t0 + 16, stop)) of a K or V cache.
  void start_tokens(const DecodeArgs& a, const uint16_t* cache, const int64_t* table, int64_t t0, int64_t stop,
                    int64_t h0, int64_t h1) {
    const int n = (int)std::min<int64_t>(16, stop - t0);
    if (n <= 0) return void(n_rows = 0);
    const uint16_t* tokens[16];
    token_rows(cache, table, a.block_size, a.cache_stride_block, a.cache_stride_token, t0, n, tokens);
    start(tokens, n, h0 * a.head_dim, (h1 - h0) * a.head_dim * 2);
  }
  int lines_left() const { return (n_rows - row) * lines_per_row - line; }
  void issue(int count) {
    for (; count > 0 && row < n_rows; --count) {
      __builtin_prefetch(rows[row] + 64 * line, 0, 2);  // prefetcht1 on x86
      if (++line == lines_per_row) line = 0, ++row;
    }
  }
};

// One unit of decode work: a request's keys [start, end) for KV heads [h0, h1).
struct DecodeItem {
  const int64_t* table;  // the request's block-table row
  int64_t start, end, h0, h1;
};

// Floats per score row in a decode kernel: a multiple of 32, so a row's bf16 probabilities
// (written over its first half) always have an even, zero-padded length.
inline int64_t decode_row_stride(int64_t len) { return (len + 31) / 32 * 32; }

// The instantiation of a kernel templated on CH = head_dim / 16 (even, 2..16) for head_dim.
template <typename Fn, template <int> class Kernel>
Fn for_head_dim(int64_t head_dim) {
  switch (head_dim / 16) {
    case 2: return Kernel<2>::run;
    case 4: return Kernel<4>::run;
    case 6: return Kernel<6>::run;
    case 8: return Kernel<8>::run;
    case 10: return Kernel<10>::run;
    case 12: return Kernel<12>::run;
    case 14: return Kernel<14>::run;
    default: return Kernel<16>::run;
  }
}

}  // namespace kvserve
