// Paged decode and prefill attention against a float64 softmax (kernel_check.cpp), on the
// shape classes of tests/test_cpu_ops.py.
#pragma once

#include "check_common.h"

namespace check {

// The attention tolerance of tests/test_cpu_ops.py: probabilities are rounded to bf16 before
// the PV product and the output is bf16.
constexpr double kAttnTol = 2e-2;
constexpr const char* kAttnTolText = "atol 2e-2 + rtol 2e-2: bf16 probabilities, bf16 output";

// A paged cache [blocks, block_size, kv_heads, d] of random bf16 K and V.
struct PagedCache {
  int64_t block_size, kv_heads, d;
  std::vector<uint16_t> k, v;
  PagedCache(Rng& rng, int64_t blocks, int64_t block_size, int64_t kv_heads, int64_t d)
      : block_size(block_size), kv_heads(kv_heads), d(d),
        k(rng.bf16s(blocks * block_size * kv_heads * d)), v(rng.bf16s(blocks * block_size * kv_heads * d)) {}
  int64_t stride_block() const { return block_size * kv_heads * d; }
  int64_t stride_token() const { return kv_heads * d; }
  // Element offset of token t's head h in a cache, through one table row.
  int64_t at(const int64_t* row, int64_t t, int64_t h) const {
    return row[t / block_size] * stride_block() + (t % block_size) * stride_token() + h * d;
  }
};

// One query head over keys [first, n) of a request (table row `row`): softmax(scale q.k + bias)
// @ V in float64 (scores soft-capped as softcap * tanh(s / softcap) when softcap > 0), into out[0 .. d).
inline void reference_head(const PagedCache& c, const int64_t* row, const uint16_t* q, int64_t kv_head,
                           int64_t first, int64_t n, double scale, const float* bias_row, double* out,
                           double softcap = 0) {
  const double* dbl = bf16_doubles();
  std::vector<double> s(n - first), qd(c.d);
  for (int64_t i = 0; i < c.d; ++i) qd[i] = dbl[q[i]];
  double mx = -INFINITY;
  for (int64_t t = first; t < n; ++t) {
    const uint16_t* kr = c.k.data() + c.at(row, t, kv_head);
    double dot = 0;
    for (int64_t i = 0; i < c.d; ++i) dot += qd[i] * dbl[kr[i]];
    s[t - first] = dot * scale + (bias_row ? bias_row[t] : 0.0);
    if (softcap > 0) s[t - first] = softcap * std::tanh(s[t - first] / softcap);
    mx = std::max(mx, s[t - first]);
  }
  double sum = 0;
  for (double& e : s) sum += (e = std::exp(e - mx));
  for (int64_t i = 0; i < c.d; ++i) out[i] = 0;
  for (int64_t t = first; t < n; ++t) {
    const uint16_t* vr = c.v.data() + c.at(row, t, kv_head);
    const double p = s[t - first] / sum;
    for (int64_t i = 0; i < c.d; ++i) out[i] += p * dbl[vr[i]];
  }
}

// ---- decode -----------------------------------------------------------------------------------

struct DecodeCase {
  int64_t reqs, heads, kv_heads, d, window, block_size;
  bool bias;
  float scale;  // 0: 1 / sqrt(d)
  int64_t extra;  // bias columns past the longest request
  float softcap = 0.f;
};

inline void run_decode_case(Ctx& c, const DecodeCase& t, uint64_t seed) {
  Rng rng(seed);
  std::vector<int64_t> lens(t.reqs);
  for (auto& n : lens) n = rng.randint(1, 200);
  lens[0] = 1;  // a fresh request
  const int64_t max_len = *std::max_element(lens.begin(), lens.end());
  const int64_t max_blocks = (max_len + t.block_size - 1) / t.block_size, blocks = t.reqs * max_blocks + 1;
  const PagedCache cache(rng, blocks, t.block_size, t.kv_heads, t.d);
  const auto perm = rng.permutation(blocks - 1);  // never block 0
  std::vector<int64_t> table(t.reqs * max_blocks);
  for (size_t i = 0; i < table.size(); ++i) table[i] = perm[i] + 1;
  // q as the model makes it: the first H heads of [B, H + KvH, D]
  const int64_t q_req = (t.heads + t.kv_heads) * t.d;
  const auto q = rng.bf16s(t.reqs * q_req);
  const int64_t bias_len = max_len + t.extra;
  const auto bias = t.bias ? rng.floats(t.heads * bias_len, 3.0) : std::vector<float>();
  const float scale = t.scale > 0 ? t.scale : 1.f / std::sqrt((float)t.d);

  kvserve::DecodeArgs a{t.kv_heads, t.heads / t.kv_heads, t.d, t.block_size, q_req, t.d,
                        cache.stride_block(), cache.stride_token(), max_blocks, t.window, scale};
  if (t.bias) a.bias = bias.data(), a.bias_stride = bias_len, a.bias_len = bias_len;
  a.softcap = t.softcap;
  std::vector<double> ref(t.reqs * t.heads * t.d);
  for (int64_t b = 0; b < t.reqs; ++b)
    for (int64_t h = 0; h < t.heads; ++h) {
      const int64_t n = lens[b], first = t.window > 0 ? std::max<int64_t>(0, n - t.window) : 0;
      // key t gets bias[h, bias_len - n + t]: a row pointer shifted so that it is indexed by t
      const float* bias_row = t.bias ? bias.data() + h * bias_len + (bias_len - n) : nullptr;
      reference_head(cache, table.data() + b * max_blocks, q.data() + b * q_req + h * t.d, h / a.group, first, n,
                     scale, bias_row, ref.data() + (b * t.heads + h) * t.d, t.softcap);
    }
  const std::string shape = fmt("reqs=%lld heads=%lld/%lld d=%lld window=%lld block=%lld", (long long)t.reqs,
                                (long long)t.heads, (long long)t.kv_heads, (long long)t.d, (long long)t.window,
                                (long long)t.block_size) +
                            (t.bias ? fmt(" bias scale=%g extra=%lld", scale, (long long)t.extra) : "") +
                            (t.softcap > 0 ? fmt(" softcap=%g", t.softcap) : "");
  c.each_host([&] {
    std::vector<uint16_t> out(t.reqs * t.heads * t.d, kBf16Nan);
    c.set->decode_attention(a, q.data(), cache.k.data(), cache.v.data(), table.data(), lens.data(), t.reqs,
                            out.data());
    Compare cmp;
    for (size_t i = 0; i < out.size(); ++i) cmp.add(bf16_to_float(out[i]), ref[i], kAttnTol, kAttnTol);
    c.add(cmp.ok, "decode_attention", shape, cmp.detail(kAttnTolText));
  });
}

inline void check_decode_attention(Ctx& c) {
  if (!c.present((const void*)c.set->decode_attention, "decode_attention")) return;
  const int64_t heads[][2] = {{4, 4}, {9, 3}, {8, 1}};  // MHA, GQA, MQA
  uint64_t seed = 0;
  for (const auto& hk : heads)
    for (int64_t d : {32, 64, 96, 128})
      for (int64_t window : {0, 37})
        for (int64_t block_size : {16, 5})  // 5: 16-token groups straddle blocks
          for (int64_t reqs : {7, 2})  // 2: one work item per (request, KV head)
            if (c.runs(++seed)) run_decode_case(c, {reqs, hk[0], hk[1], d, window, block_size, false, 0.f, 0}, seed);
  // T5's relative bias by distance; a table as long as the longest request, or longer
  for (const auto& hk : {std::pair<int64_t, int64_t>{4, 4}, {6, 2}})
    for (int64_t extra : {0, 13})
      for (float scale : {1.f, 0.125f})
        if (c.runs(++seed)) run_decode_case(c, {5, hk.first, hk.second, 64, 0, 16, true, scale, extra}, seed);
  // Gemma 2's logit soft-capping (a small cap: most scores capped)
  for (const auto& hk : {std::pair<int64_t, int64_t>{9, 3}, {8, 1}})
    for (int64_t window : {0, 37})
      if (c.runs(++seed)) run_decode_case(c, {7, hk.first, hk.second, 64, window, 5, false, 0.f, 0, 1.5f}, seed);
  // head sizes over 128: the kernels take their dims in more than one register block
  for (int64_t d : {160, 256})
    for (int64_t window : {0, 37})
      if (c.runs(++seed)) run_decode_case(c, {7, 9, 3, d, window, 5, false, 0.f, 0}, seed);
}

// ---- prefill ----------------------------------------------------------------------------------

struct PrefillCase {
  int64_t heads, kv_heads, d, cached, fresh, window, block_size;
  float softcap = 0.f;
};

inline void run_prefill_case(Ctx& c, const PrefillCase& t, uint64_t seed) {
  Rng rng(seed);
  const int64_t seq_len = t.cached + t.fresh, blocks = (seq_len + t.block_size - 1) / t.block_size;
  const PagedCache cache(rng, blocks + 5, t.block_size, t.kv_heads, t.d);
  const auto perm = rng.permutation(blocks + 4);
  std::vector<int64_t> row(blocks);
  for (int64_t i = 0; i < blocks; ++i) row[i] = perm[i] + 1;
  const int64_t q_tok = (t.heads + t.kv_heads) * t.d;  // q strided, as the model passes it
  const auto q = rng.bf16s(t.fresh * q_tok);
  const float scale = 1.f / std::sqrt((float)t.d);
  const int64_t width = t.heads * t.d, out_stride = width + 16;  // rows of a wider output
  kvserve::PrefillArgs a{t.heads / t.kv_heads, t.d, t.block_size, q_tok, t.d, cache.stride_block(),
                         cache.stride_token(), t.cached, seq_len, t.window, scale, t.softcap};
  // each new token is a decode over the keys up to its own position
  std::vector<double> ref(t.fresh * width);
  for (int64_t i = 0; i < t.fresh; ++i) {
    const int64_t n = t.cached + i + 1, first = t.window > 0 ? std::max<int64_t>(0, n - t.window) : 0;
    for (int64_t h = 0; h < t.heads; ++h)
      reference_head(cache, row.data(), q.data() + i * q_tok + h * t.d, h / a.group, first, n, scale, nullptr,
                     ref.data() + i * width + h * t.d, t.softcap);
  }
  const std::string shape = fmt("heads=%lld/%lld d=%lld cached=%lld new=%lld window=%lld block=%lld",
                                (long long)t.heads, (long long)t.kv_heads, (long long)t.d, (long long)t.cached,
                                (long long)t.fresh, (long long)t.window, (long long)t.block_size) +
                            (t.softcap > 0 ? fmt(" softcap=%g", t.softcap) : "");
  c.each_host([&] {
    std::vector<uint16_t> out(t.fresh * out_stride, kBf16Nan);
    c.set->prefill_attention(a, q.data(), cache.k.data(), cache.v.data(), row.data(), t.kv_heads, t.fresh,
                             out.data(), out_stride);
    Compare cmp;
    bool gap_kept = true;
    for (int64_t i = 0; i < t.fresh; ++i) {
      for (int64_t e = 0; e < width; ++e)
        cmp.add(bf16_to_float(out[i * out_stride + e]), ref[i * width + e], kAttnTol, kAttnTol);
      for (int64_t e = width; e < out_stride; ++e) gap_kept = gap_kept && out[i * out_stride + e] == kBf16Nan;
    }
    c.add(cmp.ok && gap_kept, "prefill_attention", shape,
          cmp.detail(kAttnTolText) + (gap_kept ? "" : "; wrote between rows (past H * D of an out_stride row)"));
  });
}

inline void check_prefill_attention(Ctx& c) {
  if (!c.present((const void*)c.set->prefill_attention, "prefill_attention")) return;
  const int64_t heads[][2] = {{9, 3}, {4, 4}, {8, 1}, {32, 1}};  // (32, 1): 512 query rows per block
  const int64_t spans[][3] = {  // (cached, new, window)
      {0, 1, 0}, {0, 37, 0}, {0, 130, 0}, {45, 20, 0}, {100, 1, 0}, {0, 130, 40}, {70, 33, 24}};
  uint64_t seed = 100;
  for (const auto& hk : heads)
    for (int64_t d : {32, 64, 96, 128})
      for (const auto& s : spans) {
        if (c.runs(++seed)) run_prefill_case(c, {hk[0], hk[1], d, s[0], s[1], s[2], 16}, seed);
        if (hk[0] == 9 && d == 64 && c.runs(++seed))  // blocks of 5
          run_prefill_case(c, {hk[0], hk[1], d, s[0], s[1], s[2], 5}, seed);
      }
  for (const auto& hk : heads)  // Gemma 2's logit soft-capping
    if (c.runs(++seed)) run_prefill_case(c, {hk[0], hk[1], 64, 45, 40, hk[0] == 9 ? 24 : 0, 16, 1.5f}, seed);
  for (int64_t d : {160, 256})  // head sizes over 128 (more than one register block of dims)
    for (const auto& s : {spans[2], spans[6]})
      if (c.runs(++seed)) run_prefill_case(c, {9, 3, d, s[0], s[1], s[2], 16}, seed);
}

}  // namespace check
