// Shared by the kernel-set test driver (kernel_check.cpp): deterministic random inputs, bf16 /
// fp16 conversions written independently of the sets' own (kernel_common.h), the result report
// and the comparison of a kernel's output with a float64 reference.
#pragma once

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "kernels.h"

namespace check {

// ---- numbers ----------------------------------------------------------------------------------

inline float bf16_to_float(uint16_t v) {
  const uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// fp32 -> bf16, round to nearest even (NaN -> quiet NaN), as PyTorch rounds.
inline uint16_t float_to_bf16(float f) {
  if (std::isnan(f)) return 0x7FC0;
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  const uint32_t lsb = (bits >> 16) & 1;
  return static_cast<uint16_t>((bits + 0x7FFFu + lsb) >> 16);
}

// Every bf16 value as a double, by its bits: the references' inner loops read these (a table
// lookup, no float conversion: under an emulator each conversion is a slow helper call).
inline const double* bf16_doubles() {
  static const std::vector<double> table = [] {
    std::vector<double> t(65536);
    for (uint32_t i = 0; i < 65536; ++i) t[i] = bf16_to_float(static_cast<uint16_t>(i));
    return t;
  }();
  return table.data();
}

// The bf16 rounding of an fp32 value, kept as fp32 (one model-dtype op's rounding).
inline float round_bf16(float f) { return bf16_to_float(float_to_bf16(f)); }

// A bf16 NaN: outputs are filled with it first, so an element a kernel leaves unwritten fails.
constexpr uint16_t kBf16Nan = 0x7FC0;

inline double fp16_to_double(uint16_t h) {
  const int exp = (h >> 10) & 0x1F, mant = h & 0x3FF;
  const double sign = (h & 0x8000) ? -1.0 : 1.0;
  if (exp == 0) return sign * std::ldexp(mant, -24);
  if (exp == 31) return mant ? NAN : sign * INFINITY;
  return sign * std::ldexp(1024 + mant, exp - 25);
}

// xorshift64* with a Box-Muller normal: the same inputs on every platform and compiler. Bulk
// values come from a table of 4096 normal samples (integer work only: under an emulator the
// libm calls of Box-Muller per value would cost more than the kernels).
struct Rng {
  uint64_t s;
  explicit Rng(uint64_t seed) : s(seed * 0x9E3779B97F4A7C15ull + 0x1234567ull) { next(); }
  uint64_t next() {
    s ^= s >> 12, s ^= s << 25, s ^= s >> 27;
    return s * 0x2545F4914F6CDD1Dull;
  }
  double uniform() { return (next() >> 11) * (1.0 / 9007199254740992.0); }  // [0, 1)
  int64_t randint(int64_t lo, int64_t hi) { return lo + static_cast<int64_t>(next() % (uint64_t)(hi - lo)); }
  double normal() {
    const double u1 = 1.0 - uniform(), u2 = uniform();
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
  }
  static const float* normal_table() {  // 4096 standard normal samples
    static const std::vector<float> table = [] {
      Rng rng(12345);
      std::vector<float> t(4096);
      for (auto& v : t) v = static_cast<float>(rng.normal());
      return t;
    }();
    return table.data();
  }
  float table_normal() { return normal_table()[next() >> 52]; }
  // n bf16 values ~ N(0, scale^2) (for a power-of-two scale, exactly the table's values scaled)
  std::vector<uint16_t> bf16s(size_t n, float scale = 1.f) {
    std::vector<uint16_t> v(n);
    for (auto& e : v) e = float_to_bf16(table_normal() * scale);
    return v;
  }
  // n fp32 values ~ N(0, scale^2), nearly all distinct (the table's value plus a small jitter)
  std::vector<float> floats(size_t n, float scale = 1.f) {
    std::vector<float> v(n);
    for (auto& e : v) e = (table_normal() + static_cast<float>(next() >> 40) * 0x1p-33f) * scale;
    return v;
  }
  // A random order of 0 .. n - 1.
  std::vector<int64_t> permutation(int64_t n) {
    std::vector<int64_t> p(n);
    for (int64_t i = 0; i < n; ++i) p[i] = i;
    for (int64_t i = n - 1; i > 0; --i) std::swap(p[i], p[randint(0, i + 1)]);
    return p;
  }
};

// ---- the report -------------------------------------------------------------------------------

struct Report {
  int passed = 0, failed = 0;
  std::vector<std::string> failures;
  bool verbose = true;

  void add(bool ok, const std::string& name, const std::string& detail) {
    ok ? ++passed : ++failed;
    const std::string line = std::string(ok ? "PASS " : "FAIL ") + name + "  " + detail;
    if (!ok) failures.push_back(line);
    if (verbose || !ok) std::printf("%s\n", line.c_str());
  }
};

// The checks' view of the set under test: its table, the hosts to run each kernel on (the
// reference is computed once per case, the kernel once per host), where results go.
struct Ctx {
  using Loader = const kvserve::KernelSet* (*)(const kvserve::Host*);
  struct HostEntry {
    const char* name;
    const kvserve::Host* host;
  };
  Loader load;
  std::vector<HostEntry> hosts;
  Report* report;
  const kvserve::KernelSet* set = nullptr;
  const char* host = "";
  bool quick = false;  // --quick: every third attention case, fewer large linears (emulators)
  double kernel_seconds = 0;  // time spent in each_host (the kernels and their comparisons)

  // fn() once per host, with `set` handed out for that host (the entry point keeps the host it
  // is given, so calling it again switches hosts).
  template <typename Fn>
  void each_host(const Fn& fn) {
    const auto t0 = std::chrono::steady_clock::now();
    for (const HostEntry& h : hosts) {
      set = load(h.host), host = h.name;
      fn();
    }
    kernel_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  void add(bool ok, const std::string& kernel, const std::string& shape, const std::string& detail) const {
    report->add(ok, kernel + " [" + shape + "] host=" + host, detail);
  }
  // Whether the n-th case of a family runs: all of them, or every third with --quick.
  bool runs(int64_t n) const { return !quick || n % 3 == 0; }
  // A kernel the set's table leaves out is one failure (not a crash): true when present.
  bool present(const void* fn, const char* kernel) {
    if (!fn) {
      host = "any";
      add(false, kernel, "all", "missing from the set's table (nullptr)");
    }
    return fn != nullptr;
  }
};

inline std::string fmt(const char* f, ...) __attribute__((format(printf, 1, 2)));
inline std::string fmt(const char* f, ...) {
  char buf[512];
  va_list args;
  va_start(args, f);
  std::vsnprintf(buf, sizeof(buf), f, args);
  va_end(args);
  return buf;
}

// |got - ref| <= atol + rtol * |ref| element by element (NaN in got fails). Returns the detail
// for the report line: the largest error, the worst element's position relative to its bound.
struct Compare {
  bool ok = true;
  double max_err = 0, worst_ratio = -1;
  size_t worst = 0, count = 0;
  double worst_got = 0, worst_ref = 0;

  void add(double got, double ref, double atol, double rtol) {
    const double err = std::fabs(got - ref), bound = atol + rtol * std::fabs(ref);
    const bool bad = !(err <= bound) || std::isnan(got) != std::isnan(ref);
    const double ratio = std::isnan(err) ? INFINITY : (bound > 0 ? err / bound : (err > 0 ? INFINITY : 0));
    if (!std::isnan(err)) max_err = std::max(max_err, err);
    if (bad) ok = false;
    if (ratio > worst_ratio) worst_ratio = ratio, worst = count, worst_got = got, worst_ref = ref;
    ++count;
  }
  std::string detail(const char* tol) const {
    return fmt("max_err=%.3g worst@%zu got=%.6g ref=%.6g (tol: %s)", max_err, worst, worst_got, worst_ref, tol);
  }
};

inline std::string show(uint16_t bf16) { return fmt("%.6g (0x%04x)", bf16_to_float(bf16), bf16); }
inline std::string show(int64_t v) { return fmt("%lld", (long long)v); }

// Exact equality of two bf16 (uint16_t) or int64 arrays: the first differing element.
template <typename T>
inline std::string first_difference(const std::vector<T>& a, const std::vector<T>& b, bool* equal) {
  for (size_t i = 0; i < a.size(); ++i)
    if (a[i] != b[i]) {
      *equal = false;
      return fmt("first difference @%zu: ", i) + show(a[i]) + " vs " + show(b[i]);
    }
  *equal = a.size() == b.size();
  return *equal ? "bitwise equal" : "sizes differ";
}

}  // namespace check
