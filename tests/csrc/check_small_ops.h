// The fused per-layer ops, the greedy argmax and the sampler's log-probabilities against plain
// C++ references (kernel_check.cpp). The roundings are those of the PyTorch code each op
// replaces (models/layers.py), so most of these checks are exact.
#pragma once

#include <numeric>

#include "check_common.h"

namespace check {

// ---- rms_norm / add_rms_norm ------------------------------------------------------------------

// Hugging Face's bf16 RMSNorm, out = bf16(w * bf16(x * inv)) with inv = 1 / sqrt(mean(x^2) + eps):
// exact but for inv, which a set computes in fp32 (its sum of squares in any order). The
// reference takes inv in float64 within a relative kInvSlack either way and accepts the results
// of both ends (the only two a rounding flip can give).
constexpr double kInvSlack = 2e-5;  // > (n - 1) * 2^-24 / 2 for n = 576, plus the division's
constexpr const char* kNormTol = "exact, up to the fp32 1/rms (relative 2e-5)";

struct NormRef {
  std::vector<uint16_t> lo, hi;  // the results at inv * (1 -+ kInvSlack)
};

inline NormRef rms_norm_reference(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t rows, int64_t n,
                                  float eps) {
  NormRef ref{std::vector<uint16_t>(rows * n), std::vector<uint16_t>(rows * n)};
  for (int64_t r = 0; r < rows; ++r) {
    const uint16_t* xr = x + r * ldx;
    double ss = 0;
    for (int64_t j = 0; j < n; ++j) ss += (double)bf16_to_float(xr[j]) * bf16_to_float(xr[j]);
    const double inv = 1.0 / std::sqrt(ss / n + eps);
    for (int64_t i = 0; i < n; ++i) {
      const double xi = bf16_to_float(xr[i]), wi = bf16_to_float(w[i]);
      ref.lo[r * n + i] = float_to_bf16((float)wi * round_bf16((float)(xi * inv * (1 - kInvSlack))));
      ref.hi[r * n + i] = float_to_bf16((float)wi * round_bf16((float)(xi * inv * (1 + kInvSlack))));
    }
  }
  return ref;
}

// "bitwise within the reference's two ends", or the first element that is not.
inline std::string norm_mismatch(const std::vector<uint16_t>& got, const NormRef& ref, bool* ok) {
  for (size_t i = 0; i < got.size(); ++i)
    if (got[i] != ref.lo[i] && got[i] != ref.hi[i]) {
      *ok = false;
      return fmt("@%zu got %.6g, want %.6g or %.6g", i, bf16_to_float(got[i]), bf16_to_float(ref.lo[i]),
                 bf16_to_float(ref.hi[i]));
    }
  *ok = true;
  return "all match";
}

inline void check_rms_norm(Ctx& c) {
  const bool have_norm = c.present((const void*)c.set->rms_norm_bf16, "rms_norm_bf16");
  const bool have_add = c.present((const void*)c.set->add_rms_norm_bf16, "add_rms_norm_bf16");
  const float eps = 1e-5f;
  for (int64_t n : {576, 100})
    for (int64_t rows : {1, 9, 300}) {
      Rng rng(rows * 13 + n);
      const int64_t ldx = 1000;  // strided rows, as a residual view can be
      auto x = rng.bf16s(rows * ldx, 3.f), residual = rng.bf16s(rows * n, 3.f);
      const auto w = rng.bf16s(n);
      if (rows > 1)  // a last row of small values: mean(x^2) near eps, so eps counts
        for (int64_t i = 0; i < n; ++i) {
          x[(rows - 1) * ldx + i] = float_to_bf16(bf16_to_float(x[(rows - 1) * ldx + i]) * 0x1p-10f);
          residual[(rows - 1) * n + i] = float_to_bf16(bf16_to_float(residual[(rows - 1) * n + i]) * 0x1p-10f);
        }
      const std::string shape = fmt("rows=%lld n=%lld", (long long)rows, (long long)n);
      // residual + x rounded once (PyTorch's bf16 add)
      std::vector<uint16_t> sum(rows * n);
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t i = 0; i < n; ++i)
          sum[r * n + i] = float_to_bf16(bf16_to_float(residual[r * n + i]) + bf16_to_float(x[r * ldx + i]));
      const NormRef ref = rms_norm_reference(x.data(), ldx, w.data(), rows, n, eps);
      const NormRef sum_ref = rms_norm_reference(sum.data(), n, w.data(), rows, n, eps);
      c.each_host([&] {
        if (have_norm) {
          std::vector<uint16_t> out(rows * n, kBf16Nan);
          c.set->rms_norm_bf16(x.data(), ldx, w.data(), out.data(), rows, n, eps);
          bool ok;
          const std::string detail = norm_mismatch(out, ref, &ok);
          c.add(ok, "rms_norm_bf16", shape, detail + " (tol: " + kNormTol + ")");
        }
        if (!have_add) return;
        std::vector<uint16_t> res = residual, out(rows * n, kBf16Nan);
        c.set->add_rms_norm_bf16(res.data(), x.data(), ldx, w.data(), out.data(), rows, n, eps);
        bool sum_equal, norm_equal = true, ok;
        std::string detail = "residual vs bf16(r + x): " + first_difference(res, sum, &sum_equal);
        if (have_norm) {  // the same formula as the set's own rms_norm, bit for bit
          std::vector<uint16_t> normed(rows * n, kBf16Nan);
          c.set->rms_norm_bf16(sum.data(), n, w.data(), normed.data(), rows, n, eps);
          detail += "; out vs rms_norm_bf16(sum): " + first_difference(out, normed, &norm_equal);
        }
        detail += "; out vs reference: " + norm_mismatch(out, sum_ref, &ok);
        c.add(sum_equal && norm_equal && ok, "add_rms_norm_bf16", shape,
              detail + " (tol: exact; the reference " + kNormTol + ")");
      });
    }
}

// ---- rotary -----------------------------------------------------------------------------------

inline void check_rotary(Ctx& c) {
  if (!c.present((const void*)c.set->rotary_bf16, "rotary_bf16")) return;
  // rows, rotated heads, heads after them (untouched), head_dim
  const int64_t cases[][4] = {{5, 12, 3, 64}, {3, 6, 0, 128}, {33, 4, 2, 32}, {17, 5, 1, 96}};
  for (const auto& t : cases) {
    const int64_t rows = t[0], heads = t[1], ldx = (t[1] + t[2]) * t[3], d = t[3], half = d / 2;
    Rng rng(rows * 101 + d);
    const auto before = rng.bf16s(rows * ldx);
    // models/layers.py's cache: [cos, cos] and [-sin, sin] of angles p * f, rounded to bf16
    std::vector<uint16_t> cs(rows * 2 * d);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t i = 0; i < half; ++i) {
        const double angle = rng.uniform() * 4000 * std::pow(10000.0, -2.0 * i / d);
        const uint16_t co = float_to_bf16((float)std::cos(angle)), si = float_to_bf16((float)std::sin(angle));
        cs[r * 2 * d + i] = cs[r * 2 * d + half + i] = co;
        cs[r * 2 * d + d + i] = si ^ 0x8000, cs[r * 2 * d + d + half + i] = si;
      }
    // x * cos + flip_halves(x) * sin, each product rounded to bf16, then the sum
    std::vector<uint16_t> ref = before;
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t h = 0; h < heads; ++h)
        for (int64_t i = 0; i < d; ++i) {
          const uint16_t* v = before.data() + r * ldx + h * d;
          const float co = bf16_to_float(cs[r * 2 * d + i]), si = bf16_to_float(cs[r * 2 * d + d + i]);
          const float a = round_bf16(bf16_to_float(v[i]) * co), b = round_bf16(bf16_to_float(v[(i + half) % d]) * si);
          ref[r * ldx + h * d + i] = float_to_bf16(a + b);
        }
    c.each_host([&] {
      auto x = before;
      c.set->rotary_bf16(x.data(), ldx, cs.data(), rows, heads, d);
      bool equal;
      const std::string detail = first_difference(x, ref, &equal);
      c.add(equal, "rotary_bf16", fmt("rows=%lld heads=%lld (+%lld untouched) d=%lld", (long long)rows,
                                      (long long)heads, (long long)t[2], (long long)d),
            detail + " (tol: exact, each product rounded to bf16, then the sum; other heads untouched)");
    });
  }
}

// ---- silu_and_mul -----------------------------------------------------------------------------

inline void check_silu_and_mul(Ctx& c) {
  if (!c.present((const void*)c.set->silu_and_mul_bf16, "silu_and_mul_bf16")) return;
  const int64_t cases[][2] = {{1, 1536}, {7, 100}, {64, 1536}, {300, 1536}, {3, 37}};
  for (const auto& t : cases) {
    const int64_t rows = t[0], n = t[1], ldx = rows % 2 ? 2 * n : 2 * n + 24;
    Rng rng(rows * 7 + n);
    auto x = rng.bf16s(rows * ldx, 4.0);
    x[0] = float_to_bf16(-100.f), x[1] = float_to_bf16(100.f), x[2] = 0;  // saturated and zero gates
    std::vector<float> ref(rows * n);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t i = 0; i < n; ++i) {
        const double g = bf16_to_float(x[r * ldx + i]);
        const float silu = round_bf16((float)(g / (1.0 + std::exp(-g))));  // F.silu's bf16 result
        ref[r * n + i] = round_bf16(silu * bf16_to_float(x[r * ldx + n + i]));
      }
    c.each_host([&] {
      std::vector<uint16_t> out(rows * n, kBf16Nan);
      c.set->silu_and_mul_bf16(x.data(), ldx, out.data(), rows, n);
      Compare cmp;
      for (int64_t i = 0; i < rows * n; ++i) cmp.add(bf16_to_float(out[i]), ref[i], 1e-6, 1.0 / 128);
      c.add(cmp.ok, "silu_and_mul_bf16", fmt("rows=%lld n=%lld", (long long)rows, (long long)n),
            cmp.detail("atol 1e-6 + rtol 1/128: a ~1-ulp fp32 exp may flip silu's bf16 rounding"));
    });
  }
}

// ---- argmax -----------------------------------------------------------------------------------

inline void check_argmax(Ctx& c) {
  if (!c.present((const void*)c.set->argmax_bf16, "argmax_bf16")) return;
  for (int64_t v : {1, 15, 16, 17, 49152, 50257}) {
    Rng rng(v);
    const int64_t rows = 9, ld = v + 8;
    auto x = rng.bf16s(rows * ld);
    auto row = [&](int64_t r) { return x.data() + r * ld; };
    std::fill(row(1), row(1) + v, 0);  // all tied: the first index
    std::fill(row(2) + v / 2, row(2) + v, float_to_bf16(100.f));  // a tie between the halves
    row(3)[v - 1] = float_to_bf16(1000.f);  // the maximum in the tail
    std::fill(row(4), row(4) + v, float_to_bf16(-INFINITY));
    row(4)[v / 3] = float_to_bf16(-1e30f);
    std::vector<int64_t> ref(rows, 0);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t i = 1; i < v; ++i)
        if (bf16_to_float(row(r)[i]) > bf16_to_float(row(r)[ref[r]])) ref[r] = i;
    c.each_host([&] {
      std::vector<int64_t> got(rows, -1);
      c.set->argmax_bf16(x.data(), ld, rows, v, got.data());
      bool equal;
      const std::string detail = first_difference(got, ref, &equal);
      c.add(equal, "argmax_bf16", fmt("rows=%lld v=%lld", (long long)rows, (long long)v),
            detail + " (tol: exact, ties to the first index)");
    });
  }
}

// ---- logprobs_topk ----------------------------------------------------------------------------

inline void check_logprobs_topk(Ctx& c) {
  if (!c.present((const void*)c.set->logprobs_topk, "logprobs_topk")) return;
  const int64_t cases[][3] = {{3, 100, 5}, {64, 5003, 20}, {4, 17, 17}, {2, 33, 0}, {1, 16, 1}};
  for (const auto& t : cases)
    for (bool as_bf16 : {false, true}) {
      const int64_t rows = t[0], v = t[1], k = t[2], ld = v + (rows % 2 ? 0 : 5);
      Rng rng(rows + v + as_bf16);
      std::vector<float> x = rng.floats(rows * ld, 4.0);
      if (as_bf16)
        for (auto& e : x) e = round_bf16(e);
      const float top = *std::max_element(x.begin(), x.begin() + v) + 1;
      x[v / 2] = x[v / 3] = as_bf16 ? round_bf16(top) : top;  // a tie at the top
      std::vector<int64_t> tokens(rows);
      for (auto& e : tokens) e = rng.randint(0, v);
      std::vector<uint16_t> xb(x.size());
      for (size_t i = 0; i < x.size(); ++i) xb[i] = float_to_bf16(x[i]);
      // the reference: log-softmax in float64, ids by (value descending, id ascending)
      std::vector<double> want_sampled(rows), want_vals(rows * k);
      std::vector<int64_t> want_ids(rows * k);
      for (int64_t r = 0; r < rows; ++r) {
        const float* xr = x.data() + r * ld;
        double mx = -INFINITY, sum = 0;
        for (int64_t i = 0; i < v; ++i) mx = std::max(mx, (double)xr[i]);
        for (int64_t i = 0; i < v; ++i) sum += std::exp(xr[i] - mx);
        const double norm = mx + std::log(sum);
        want_sampled[r] = xr[tokens[r]] - norm;
        std::vector<int64_t> order(v);
        std::iota(order.begin(), order.end(), 0);
        std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return xr[a] > xr[b]; });
        for (int64_t j = 0; j < k; ++j) want_ids[r * k + j] = order[j], want_vals[r * k + j] = xr[order[j]] - norm;
      }
      c.each_host([&] {
        const size_t nk = std::max<int64_t>(1, rows * k);
        std::vector<float> sampled(rows, NAN), vals(nk, NAN);
        std::vector<int64_t> ids(nk, -1);
        c.set->logprobs_topk(as_bf16 ? (const void*)xb.data() : (const void*)x.data(), as_bf16, ld, rows, v,
                             tokens.data(), k, sampled.data(), vals.data(), ids.data());
        Compare cmp;
        for (int64_t r = 0; r < rows; ++r) cmp.add(sampled[r], want_sampled[r], 1e-5, 1e-6);
        for (int64_t j = 0; j < rows * k; ++j) cmp.add(vals[j], want_vals[j], 1e-5, 1e-6);
        bool ids_equal = true;
        std::string detail = "ids: ";
        ids.resize(rows * k);
        detail += first_difference(ids, want_ids, &ids_equal);
        c.add(cmp.ok && ids_equal, "logprobs_topk",
              fmt("rows=%lld v=%lld k=%lld x=%s", (long long)rows, (long long)v, (long long)k,
                  as_bf16 ? "bf16" : "fp32"),
              detail + "; values " + cmp.detail("atol 1e-5 + rtol 1e-6: fp32 sums in any order; ids exact"));
      });
    }
}

}  // namespace check
