// The bf16 linear and the int8 / int4 linear against float64 references (kernel_check.cpp).
#pragma once

#include "check_common.h"

namespace check {

// ---- linear_bf16 ------------------------------------------------------------------------------

// a . b in float64 with 4 partial sums (the reference's cost dominates the driver's run time)
inline double dot(const double* a, const double* b, int64_t n) {
  double s[4] = {0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 4 <= n; i += 4)
    for (int j = 0; j < 4; ++j) s[j] += a[i + j] * b[i + j];
  for (; i < n; ++i) s[0] += a[i] * b[i];
  return (s[0] + s[1]) + (s[2] + s[3]);
}

// models/cpu_ops.pack_linear_weight: [N, K] -> [ceil(N/64)][K/2][64][2], padding columns zero.
inline std::vector<uint16_t> pack_linear(const std::vector<uint16_t>& w, int64_t n, int64_t k) {
  const int64_t blocks = (n + 63) / 64, half_k = k / 2;
  std::vector<uint16_t> p(blocks * half_k * 128, 0);
  for (int64_t col = 0; col < n; ++col)
    for (int64_t kk = 0; kk < k; ++kk)
      p[((col / 64) * half_k + kk / 2) * 128 + (col % 64) * 2 + kk % 2] = w[col * k + kk];
  return p;
}

// y = x @ W.T (+ bias), rows of x ldx apart -> [m, n] bf16 (NaN-filled first).
inline std::vector<uint16_t> run_linear(Ctx& c, const std::vector<uint16_t>& x, int64_t ldx, int64_t m,
                                        const std::vector<uint16_t>& packed, int64_t n, int64_t k,
                                        const float* bias) {
  std::vector<uint16_t> y(m * n, kBf16Nan);
  c.set->linear_bf16(x.data(), ldx, m, packed.data(), k / 2, (n + 63) / 64, bias, y.data(), n);
  return y;
}

inline void check_linear_bf16(Ctx& c) {
  if (!c.present((const void*)c.set->linear_bf16, "linear_bf16")) return;
  const int64_t shapes[][2] = {{576, 960}, {64, 50}, {130, 17}, {1536, 200}};
  for (const auto& kn : shapes)
    for (int64_t m : {1, 2, 5, 6, 7, 33, 100, 300})
      for (bool with_bias : {false, true}) {
        const int64_t k = kn[0], n = kn[1];
        // --quick: one bias setting per row count, no 100 or 300 rows on the large matrices
        if (c.quick && (with_bias != (m % 2 == 1) || (m >= 100 && k * n >= 100000))) continue;
        Rng rng(1000 * m + k + n + with_bias);
        const int64_t ldx = m % 2 ? k : k + 32;  // even row counts: rows of a wider tensor
        const auto x = rng.bf16s(m * ldx), w = rng.bf16s(n * k);
        const auto bias = rng.floats(n);
        const auto packed = pack_linear(w, n, k);
        std::vector<double> ref(m * n);  // float64, 4 partial sums (vectorizable)
        std::vector<double> xd(k), wd(n * k);
        for (int64_t i = 0; i < n * k; ++i) wd[i] = bf16_doubles()[w[i]];
        for (int64_t r = 0; r < m; ++r) {
          for (int64_t kk = 0; kk < k; ++kk) xd[kk] = bf16_doubles()[x[r * ldx + kk]];
          for (int64_t col = 0; col < n; ++col) ref[r * n + col] = dot(xd.data(), wd.data() + col * k, k) +
                                                                   (with_bias ? bias[col] : 0.0);
        }
        c.each_host([&] {
          const auto y = run_linear(c, x, ldx, m, packed, n, k, with_bias ? bias.data() : nullptr);
          Compare cmp;
          for (int64_t i = 0; i < m * n; ++i) cmp.add(bf16_to_float(y[i]), ref[i], 0.05, 1.0 / 128);
          c.add(cmp.ok, "linear_bf16", fmt("m=%lld K=%lld N=%lld bias=%d", (long long)m, (long long)k,
                                           (long long)n, with_bias),
                cmp.detail("atol 0.05 + rtol 1/128: fp32 sums in any order, one bf16 rounding"));
        });
      }
  // A row's result does not depend on the rows around it (AMX tiles off where the set has them).
  Rng rng(7);
  const int64_t m = 64, k = 576, n = 960;
  const auto x = rng.bf16s(m * k), w = rng.bf16s(n * k);
  const auto packed = pack_linear(w, n, k);
  c.each_host([&] {
    const bool amx_was = c.set->set_amx ? c.set->set_amx(false) : false;
    const auto all = run_linear(c, x, k, m, packed, n, k, nullptr);
    bool equal = true;
    std::string detail = "bitwise equal";
    for (int64_t r = 0; r < m && equal; r += 9) {
      const std::vector<uint16_t> row(x.begin() + r * k, x.begin() + (r + 1) * k);
      const auto alone = run_linear(c, row, k, 1, packed, n, k, nullptr);
      const std::vector<uint16_t> in_batch(all.begin() + r * n, all.begin() + (r + 1) * n);
      detail = fmt("row %lld: ", (long long)r) + first_difference(alone, in_batch, &equal);
    }
    if (c.set->set_amx) c.set->set_amx(amx_was);
    c.add(equal, "linear_bf16", "batch invariance m=64 K=576 N=960 (AMX off)", detail + " (tol: exact)");
  });
}

// ---- quant_linear -----------------------------------------------------------------------------

// models/quantization.py's packed layout from q [n, k] (int8 in [-127, 127] or int4 in
// [-8, 7]) and fp16 scales d [n, k / group]: u = q + offset; per 64-column block and step of 4
// inputs, int8: the columns' 4 bytes side by side; int4: 16-column vectors 0 | 1 << 4 in the
// first 64 bytes, 2 | 3 << 4 in the next. Scales [blocks][k / group][64], padding zero.
struct QuantWeight {
  std::vector<uint8_t> data;
  std::vector<uint16_t> scales;
};

inline QuantWeight pack_quant(const std::vector<int>& q, const std::vector<uint16_t>& d, int64_t n, int64_t k,
                              int64_t group, int bits) {
  const int64_t blocks = (n + 63) / 64, steps = k / 4, groups = k / group, step_bytes = bits == 8 ? 256 : 128;
  const int offset = bits == 8 ? 128 : 8;
  auto u = [&](int64_t col, int64_t kk) -> int { return col < n ? q[col * k + kk] + offset : 0; };
  QuantWeight p{std::vector<uint8_t>(blocks * steps * step_bytes), std::vector<uint16_t>(blocks * groups * 64, 0)};
  for (int64_t cb = 0; cb < blocks; ++cb)
    for (int64_t st = 0; st < steps; ++st) {
      uint8_t* out = p.data.data() + (cb * steps + st) * step_bytes;
      for (int64_t b = 0; b < step_bytes; ++b) {
        if (bits == 8) {
          out[b] = (uint8_t)u(cb * 64 + b / 4, 4 * st + b % 4);
        } else {  // half h of the step: columns 32h + b'/4 (low nibble) and 32h + 16 + b'/4 (high)
          const int64_t h = b / 64, bb = b % 64, col = cb * 64 + 32 * h + bb / 4;
          out[b] = (uint8_t)(u(col, 4 * st + bb % 4) | (u(col + 16, 4 * st + bb % 4) << 4));
        }
      }
    }
  for (int64_t col = 0; col < n; ++col)
    for (int64_t g = 0; g < groups; ++g) p.scales[((col / 64) * groups + g) * 64 + col % 64] = d[col * groups + g];
  return p;
}

// quantization.reference_linear: the activations quantized per row and group in fp32 (scale
// amax / 127, q = round-half-even(x * (1 / scale))), int dots per group, the rest in float64.
inline std::vector<double> quant_reference(const std::vector<float>& x, int64_t ldx, int64_t m, int64_t k,
                                           const std::vector<int>& q, const std::vector<uint16_t>& d, int64_t n,
                                           int64_t group, const float* bias) {
  const int64_t groups = k / group;
  std::vector<double> y(m * n);
  std::vector<int> qx(k);
  std::vector<float> dx(groups);
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t g = 0; g < groups; ++g) {
      float amax = 0;
      for (int64_t i = 0; i < group; ++i) amax = std::max(amax, std::fabs(x[r * ldx + g * group + i]));
      const float scale = amax / 127.f, inv = scale == 0.f ? 0.f : 1.f / scale;
      for (int64_t i = 0; i < group; ++i) qx[g * group + i] = (int)std::nearbyint(x[r * ldx + g * group + i] * inv);
      dx[g] = scale;
    }
    for (int64_t col = 0; col < n; ++col) {
      double acc = bias ? bias[col] : 0.0;
      for (int64_t g = 0; g < groups; ++g) {
        int64_t dot = 0;
        for (int64_t i = g * group; i < (g + 1) * group; ++i) dot += (int64_t)qx[i] * q[col * k + i];
        acc += (double)dot * dx[g] * fp16_to_double(d[col * groups + g]);
      }
      y[r * n + col] = acc;
    }
  }
  return y;
}

// y [m, n] (bf16 bits widened to float, or float32) of quant_linear on x given as float32 values
// (converted to bf16 first when as_bf16: they are bf16 values already).
inline std::vector<float> run_quant(Ctx& c, const std::vector<float>& x, int64_t ldx, int64_t m, int64_t k,
                                    const QuantWeight& w, int bits, int64_t group, const float* bias, int64_t n,
                                    bool as_bf16) {
  std::vector<float> out(m * n);
  if (as_bf16) {
    std::vector<uint16_t> xb(x.size()), y(m * n, kBf16Nan);
    for (size_t i = 0; i < x.size(); ++i) xb[i] = float_to_bf16(x[i]);
    c.set->quant_linear(xb.data(), true, ldx, m, k, w.data.data(), w.scales.data(), bits, group, bias, y.data(), n,
                        (n + 63) / 64);
    for (int64_t i = 0; i < m * n; ++i) out[i] = bf16_to_float(y[i]);
  } else {
    out.assign(m * n, NAN);
    c.set->quant_linear(x.data(), false, ldx, m, k, w.data.data(), w.scales.data(), bits, group, bias, out.data(),
                        n, (n + 63) / 64);
  }
  return out;
}

inline void check_quant_linear(Ctx& c) {
  if (!c.present((const void*)c.set->quant_linear, "quant_linear")) return;
  struct Case { int64_t m, n, k, group; int bits; bool bias; };
  const Case cases[] = {  // tests/test_quantization.py's KERNEL_CASES, and groups of 128
      {1, 100, 96, 32, 8, true},   {1, 130, 256, 64, 4, false}, {2, 64, 128, 32, 4, true},
      {3, 100, 192, 64, 8, false}, {5, 130, 96, 32, 8, true},   {5, 1, 64, 16, 4, true},
      {7, 70, 144, 48, 8, true},   {97, 130, 128, 32, 4, true}, {97, 64, 256, 64, 8, false},
      {300, 200, 96, 32, 8, true}, {300, 100, 192, 64, 4, true}, {1, 200, 256, 128, 8, true},
      {9, 130, 384, 128, 4, false}, {40, 64, 512, 128, 4, true}, {33, 257, 256, 128, 8, false}};
  for (const Case& t : cases) {
    Rng rng(t.m * 7919 + t.n * 31 + t.k + t.bits);
    const int64_t groups = t.k / t.group, ldx = t.m % 2 ? t.k + 16 : t.k;
    std::vector<int> q(t.n * t.k);
    for (auto& v : q) v = t.bits == 8 ? (int)rng.randint(-127, 128) : (int)rng.randint(-8, 8);
    std::vector<uint16_t> d(t.n * groups);  // fp16 scales of magnitude 2^-11 .. 2^-8 (int4: either sign)
    for (auto& v : d)
      v = (uint16_t)(((t.bits == 4 && rng.randint(0, 2)) ? 0x8000 : 0) | ((rng.randint(4, 8)) << 10) |
                     rng.randint(0, 1024));
    const QuantWeight w = pack_quant(q, d, t.n, t.k, t.group, t.bits);
    const auto bias = rng.floats(t.n);
    const float* b = t.bias ? bias.data() : nullptr;
    std::vector<float> x = rng.floats(t.m * ldx);
    if (t.m > 2) {
      for (int64_t i = 0; i < t.k; ++i) x[1 * ldx + i] = 0.f;  // a zero row: activation scale 0
      x[2 * ldx] = 40.f;  // an outlier: the rest of its group rounds coarsely
    }
    for (auto& v : x) v = round_bf16(v);  // bf16 values, the same for both input dtypes
    const std::string shape = fmt("m=%lld N=%lld K=%lld group=%lld int%d bias=%d", (long long)t.m, (long long)t.n,
                                  (long long)t.k, (long long)t.group, t.bits, t.bias);
    const auto ref = quant_reference(x, ldx, t.m, t.k, q, d, t.n, t.group, b);
    double scale = 0;
    for (double v : ref) scale = std::max(scale, std::fabs(v));
    c.each_host([&] {
      std::vector<float> got[2];
      for (bool as_bf16 : {false, true}) {
        got[as_bf16] = run_quant(c, x, ldx, t.m, t.k, w, t.bits, t.group, b, t.n, as_bf16);
        Compare cmp;
        for (size_t i = 0; i < ref.size(); ++i)
          cmp.add(got[as_bf16][i], ref[i], 1e-5 * scale, as_bf16 ? 1.0 / 256 : 0);
        c.add(cmp.ok, "quant_linear", shape + (as_bf16 ? " x=bf16" : " x=fp32"),
              cmp.detail(as_bf16 ? "1e-5 * max|ref| + 2^-8 |ref|: fp32 sums, one bf16 rounding"
                                 : "1e-5 * max|ref|: fp32 sums of exact int dots"));
      }
      // the bf16 output is the fp32 output rounded once; a row's result is the same alone
      bool once = true;
      for (size_t i = 0; i < ref.size() && once; ++i) once = float_to_bf16(got[0][i]) == float_to_bf16(got[1][i]);
      std::string detail = once ? "bf16 y == bf16(fp32 y)" : "bf16 y != bf16(fp32 y)";
      bool alone_ok = true;
      for (int64_t r : {(int64_t)0, t.m / 2, t.m - 1}) {
        const std::vector<float> row(x.begin() + r * ldx, x.begin() + r * ldx + t.k);
        const auto alone = run_quant(c, row, t.k, 1, t.k, w, t.bits, t.group, b, t.n, false);
        for (int64_t col = 0; col < t.n; ++col)
          if (alone[col] != got[0][r * t.n + col] && alone_ok)
            alone_ok = false, detail += fmt("; row %lld col %lld differs alone", (long long)r, (long long)col);
      }
      c.add(once && alone_ok, "quant_linear", shape + " consistency", detail + " (tol: exact)");
    });
  }
}

}  // namespace check
