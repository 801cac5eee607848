// kernel_check: tests every kernel of one CPU kernel set (models/csrc/<set>/, see kernels.h)
// against plain C++ references, without torch; and the host library's LoRA kernels
// (models/csrc/host/lora.cpp: the set's tiles, and the plain loops). Built by tests/test_kernel_sets.py:
//
//   c++ -O2 -std=c++17 <the set's flags> -DKV_SET=avx2 -Imodels/csrc
//       tests/csrc/kernel_check.cpp models/csrc/avx2/*.cpp models/csrc/host/lora.cpp -o kernel_check -pthread
//
// Without -DKV_SET the program takes whichever set's entry point is linked in (declared weak).
// It runs every kernel twice: on a serial host and on a 2-thread std::thread host (the set's
// parallel_for then splits work into two chunks run at once); each reference is computed once.
// One line per check, a summary; exit status 1 on any failure, 2 when the set does not load on
// this CPU.
//
//   kernel_check [-q] [--quick] [family ...]
//     families: linear quant decode prefill norm rotary silu argmax logprobs lora (default: all)
//     -q: print failures only; --quick: every shape class, fewer cases (for an emulator)
#include <chrono>
#include <cstdlib>
#include <string>
#include <thread>

#include "check_attention.h"
#include "check_common.h"
#include "check_linear.h"
#include "check_lora.h"
#include "check_small_ops.h"

#define KV_CAT2(a, b) a##b
#define KV_CAT(a, b) KV_CAT2(a, b)
#define KV_STR2(a) #a
#define KV_STR(a) KV_STR2(a)

#ifdef KV_SET
extern "C" const kvserve::KernelSet* KV_CAT(kvserve_kernels_, KV_SET)(const kvserve::Host* host);
#else
extern "C" {
__attribute__((weak)) const kvserve::KernelSet* kvserve_kernels_avx512(const kvserve::Host* host);
__attribute__((weak)) const kvserve::KernelSet* kvserve_kernels_avx512vnni(const kvserve::Host* host);
__attribute__((weak)) const kvserve::KernelSet* kvserve_kernels_avx2(const kvserve::Host* host);
__attribute__((weak)) const kvserve::KernelSet* kvserve_kernels_neon(const kvserve::Host* host);
}
#endif

namespace {

using Body = void (*)(void* ctx, int64_t b, int64_t e);

// The C++ test host of kernels.h: everything on the calling thread.
void serial_parallel_for(int64_t begin, int64_t end, int64_t /*grain*/, Body body, void* ctx) {
  if (begin < end) body(ctx, begin, end);
}
int one_thread() { return 1; }

// Two threads, at::parallel_for's contract: chunks of at least `grain` items (one chunk when
// the range is no larger), the calling thread takes the first; nested calls run serially.
thread_local bool in_parallel_region = false;

void threaded_parallel_for(int64_t begin, int64_t end, int64_t grain, Body body, void* ctx) {
  if (begin >= end) return;
  const int64_t chunk = std::max<int64_t>({grain, (end - begin + 1) / 2, 1});
  if (in_parallel_region || chunk >= end - begin) {
    body(ctx, begin, end);
    return;
  }
  std::thread second([=] {
    in_parallel_region = true;
    body(ctx, begin + chunk, end);
  });
  in_parallel_region = true;
  body(ctx, begin, begin + chunk);
  in_parallel_region = false;
  second.join();
}
int two_threads() { return 2; }

const char* entry_name() {
#ifdef KV_SET
  return "kvserve_kernels_" KV_STR(KV_SET);
#else
  if (kvserve_kernels_avx512) return "kvserve_kernels_avx512";
  if (kvserve_kernels_avx512vnni) return "kvserve_kernels_avx512vnni";
  if (kvserve_kernels_avx2) return "kvserve_kernels_avx2";
  if (kvserve_kernels_neon) return "kvserve_kernels_neon";
  return "(no entry point linked)";
#endif
}

// The set for `host`, through its entry point (nullptr: the CPU lacks the set's instructions).
const kvserve::KernelSet* load(const kvserve::Host* host) {
#ifdef KV_SET
  return KV_CAT(kvserve_kernels_, KV_SET)(host);
#else
  if (kvserve_kernels_avx512) return kvserve_kernels_avx512(host);
  if (kvserve_kernels_avx512vnni) return kvserve_kernels_avx512vnni(host);
  if (kvserve_kernels_avx2) return kvserve_kernels_avx2(host);
  if (kvserve_kernels_neon) return kvserve_kernels_neon(host);
  return nullptr;
#endif
}

struct Family {
  const char* name;
  void (*run)(check::Ctx&);
};

const Family kFamilies[] = {
    {"linear", check::check_linear_bf16}, {"quant", check::check_quant_linear},
    {"decode", check::check_decode_attention}, {"prefill", check::check_prefill_attention},
    {"norm", check::check_rms_norm}, {"rotary", check::check_rotary},
    {"silu", check::check_silu_and_mul}, {"argmax", check::check_argmax},
    {"logprobs", check::check_logprobs_topk}, {"lora", check::check_lora},
};

}  // namespace

int main(int argc, char** argv) {
  check::Report report;
  std::vector<std::string> only;
  bool quick = false;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "-q") {
      report.verbose = false;
    } else if (arg == "--quick") {
      quick = true;
    } else {
      bool known = false;
      for (const Family& f : kFamilies) known = known || arg == f.name;
      if (!known) {
        std::fprintf(stderr, "unknown family %s\n", arg.c_str());
        return 2;
      }
      only.push_back(arg);
    }
  }
  static const kvserve::Host serial{serial_parallel_for, one_thread};
  static const kvserve::Host threaded{threaded_parallel_for, two_threads};
  check::Ctx ctx{load, {{"serial", &serial}, {"2threads", &threaded}}, &report};
  ctx.quick = quick;
  ctx.set = load(&serial);
  if (!ctx.set) {
#ifndef KV_SET
    if (!kvserve_kernels_avx512 && !kvserve_kernels_avx512vnni && !kvserve_kernels_avx2 && !kvserve_kernels_neon) {
      std::printf("FAIL no set linked: build with a set's sources (and -DKV_SET=<set>)\n");
      return 1;
    }
#endif
    std::printf("FAIL %s returned nullptr: the CPU lacks an instruction the set was built for\n", entry_name());
    return 2;
  }
  if (ctx.set->abi != kvserve::kKernelAbi) {
    std::printf("FAIL set %s has abi %d, the driver %d\n", ctx.set->name, ctx.set->abi, kvserve::kKernelAbi);
    return 1;
  }
  std::printf("== set %s (%s), hosts serial and 2threads (each check's line names its host)\n", ctx.set->name,
              entry_name());
  for (const Family& f : kFamilies)
    if (only.empty() || std::find(only.begin(), only.end(), f.name) != only.end()) {
      const auto t0 = std::chrono::steady_clock::now();
      ctx.kernel_seconds = 0;
      f.run(ctx);
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      std::printf("-- %s: %.2f s (kernels and comparisons %.2f s)\n", f.name, s, ctx.kernel_seconds);
    }
  std::printf("== %d passed, %d failed\n", report.passed, report.failed);
  for (const std::string& line : report.failures) std::printf("%s\n", line.c_str());
  return report.failed ? 1 : 0;
}
