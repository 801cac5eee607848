// The host library's LoRA shrink/expand (models/csrc/host/lora.cpp, built into the driver with the
// set's sources) against a plain C++ reference (kernel_check.cpp's family "lora"). lora.cpp picks
// its AVX2 + FMA tiles when the loaded set is an x86 one and its plain loops otherwise; the
// driver stands in for the host library's `kernel_set()` and `fail()`, so one binary runs both:
// the set under test (the tiles on x86, the plain loops on ARM) and no set (the plain loops, on any
// CPU). Each path runs on the serial and the 2-thread host (both of lora_apply's region layouts).
#pragma once

#include <string>

#include "check_common.h"
#include "host/host.h"

namespace check {
inline const kvserve::KernelSet* lora_set = nullptr;  // what lora.cpp's kernel_set() sees
}

// lora.cpp's two links to the rest of the host library (ops.cpp), here.
namespace kvserve::host_lib {
const KernelSet* kernel_set() { return check::lora_set; }
const char* fail(std::string message) {
  thread_local std::string last;
  last = std::move(message);
  return last.c_str();
}
}  // namespace kvserve::host_lib

namespace check {

struct LoraCase {
  int64_t k, rank_pad, num_tokens;
  std::vector<int64_t> shard_n;
  std::vector<int64_t> seg_lens;  // rows of slots 2, 1, 0 in turn
};

// y [num_tokens, n] after the adapters: shrink rounded to bf16, each shard's expand rounded to bf16,
// added to y and rounded (lora.cpp's roundings), sums in float64. `bound` [num_tokens, n]: how far a
// kernel's fp32 sums may move the result (a bf16 rounding flip of the shrink, the expand or the add);
// 0 for rows no adapter touches (they must stay bitwise).
inline void lora_reference(const LoraCase& lc, const std::vector<uint16_t>& x, const std::vector<uint16_t>& y0,
                           const std::vector<uint16_t>& a, const std::vector<uint16_t>& b,
                           const std::vector<int64_t>& order, const std::vector<int32_t>& row_slot,
                           const kvserve::host_lib::LoraLinear& l, std::vector<double>& ref,
                           std::vector<double>& bound) {
  const double* bf = bf16_doubles();
  const int64_t n = l.n, width = 16 * l.a_groups, rp = lc.rank_pad;
  ref.assign(lc.num_tokens * n, 0), bound.assign(lc.num_tokens * n, 0);
  for (int64_t i = 0; i < lc.num_tokens * n; ++i) ref[i] = bf[y0[i]];
  std::vector<double> s(width);
  for (size_t i = 0; i < order.size(); ++i) {
    const int64_t t = order[i], slot = row_slot[i];
    for (int64_t j = 0; j < l.num_shards * rp; ++j) {  // A: [slot][group][k][16]
      double acc = 0;
      for (int64_t kk = 0; kk < lc.k; ++kk)
        acc += bf[x[t * lc.k + kk]] * bf[a[((slot * l.a_groups + j / 16) * lc.k + kk) * 16 + j % 16]];
      s[j] = round_bf16(static_cast<float>(acc));
    }
    for (int64_t sh = 0; sh < l.num_shards; ++sh)
      for (int64_t col = 0; col < l.shard_n[sh]; ++col) {
        double acc = 0, mag = 0;
        for (int64_t r = 0; r < rp; ++r) {
          const double p = s[sh * rp + r] * bf[b[(slot * rp + r) * l.b_cols + l.shard_col[sh] + col]];
          acc += p, mag += std::fabs(p);
        }
        const int64_t at = t * n + l.shard_offset[sh] + col;
        const float sum = static_cast<float>(ref[at]) + round_bf16(static_cast<float>(acc));
        bound[at] = 0x1p-6 * (std::fabs(ref[at]) + mag);
        ref[at] = bf16_to_float(float_to_bf16(sum));
      }
  }
}

// The fp32 sums of the kernels (FMA or not, any order the compiler keeps) rarely move a bf16
// rounding: nearly every output is the reference's bits, the rest within a flip.
constexpr const char* kLoraTol = "each within a bf16 flip of the shrink, expand or add, >= 95% bitwise; untouched rows exact";

inline void check_lora(Ctx& c) {
  const std::vector<LoraCase> cases = {
      {64, 8, 5, {64}, {1}},                   // o_proj-like, one decode row: the calling thread alone
      {100, 6, 9, {40, 24, 24}, {3, 4}},       // q/k/v, odd rank 5 padded to 6, partial 16-column blocks
      {96, 16, 50, {100, 100}, {40}},          // gate/up, one slot's prefill: shrink then expand by columns
      {64, 16, 100, {48, 16, 16}, {45, 45, 1}},  // many chunks: one region, a task per chunk of rows
  };
  int64_t case_no = 0;
  for (const LoraCase& lc : cases) {
    if (!c.runs(case_no++)) continue;
    Rng rng(lc.k * 31 + lc.num_tokens);
    const int64_t num_slots = 3, num_shards = static_cast<int64_t>(lc.shard_n.size());
    kvserve::host_lib::LoraLinear l;
    int64_t n = 0;
    for (int64_t v : lc.shard_n) n += v;
    const int64_t a_groups = (num_shards * lc.rank_pad + 15) / 16;
    int64_t b_cols = 0;
    for (int64_t v : lc.shard_n) b_cols += (v + 15) / 16 * 16;
    const auto a = rng.bf16s(num_slots * a_groups * lc.k * 16, 0.125f);  // padding columns random too
    const auto b = rng.bf16s(num_slots * lc.rank_pad * b_cols, 0.25f);
    const auto x = rng.bf16s(lc.num_tokens * lc.k), y0 = rng.bf16s(lc.num_tokens * n);
    const char* err =
        kvserve::host_lib::lora_linear(l, a.data(), b.data(), lc.k, n, num_shards, lc.rank_pad, lc.shard_n.data(),
                                       num_slots);
    // rows grouped by slot (2, 1, 0), drawn from a random order of the tokens
    const std::vector<int64_t> perm = rng.permutation(lc.num_tokens);
    std::vector<int64_t> order;
    std::vector<int32_t> starts, lens, slots, row_slot;
    for (size_t g = 0; g < lc.seg_lens.size(); ++g) {
      const int32_t slot = static_cast<int32_t>((2 + 2 * g) % num_slots);
      starts.push_back(static_cast<int32_t>(order.size())), lens.push_back(lc.seg_lens[g]), slots.push_back(slot);
      for (int64_t i = 0; i < lc.seg_lens[g]; ++i) order.push_back(perm[order.size()]), row_slot.push_back(slot);
    }
    const kvserve::host_lib::LoraSegments segs{order.data(), starts.data(), lens.data(), slots.data(),
                                               static_cast<int64_t>(starts.size()),
                                               static_cast<int64_t>(order.size())};
    if (!err) err = kvserve::host_lib::check_segments(segs, lc.num_tokens, num_slots);
    const std::string shape = fmt("k=%lld n=%lld shards=%lld rank_pad=%lld rows=%zu", (long long)lc.k,
                                  (long long)n, (long long)num_shards, (long long)lc.rank_pad, order.size());
    if (err) {
      c.host = "any";
      c.add(false, "lora_apply", shape, err);
      continue;
    }
    std::vector<double> ref, bound;
    lora_reference(lc, x, y0, a, b, order, row_slot, l, ref, bound);
    c.each_host([&] {
      for (const kvserve::KernelSet* set : {c.set, static_cast<const kvserve::KernelSet*>(nullptr)}) {
        lora_set = set;
        std::vector<uint16_t> y = y0;
        kvserve::host_lib::LoraScratch scratch;
        kvserve::host_lib::lora_apply(l, segs, x.data(), lc.k, y.data(), n, scratch);
        Compare cmp;
        int64_t touched = 0, inexact = 0;
        for (size_t i = 0; i < y.size(); ++i) {
          cmp.add(bf16_to_float(y[i]), ref[i], bound[i], 0);
          touched += bound[i] > 0, inexact += bf16_to_float(y[i]) != ref[i];
        }
        c.add(cmp.ok && 20 * inexact <= touched, set ? "lora_apply(set)" : "lora_apply(plain loops)", shape,
              cmp.detail(kLoraTol) + fmt(", %lld of %lld outputs not bitwise", (long long)inexact, (long long)touched));
      }
    });
    lora_set = nullptr;
  }
}

}  // namespace check
