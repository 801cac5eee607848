// Paged prefill attention: a prompt chunk's causal attention over the paged KV cache (kernels.h).
#include "neon.h"

namespace kvserve::neon {

// ---- paged prefill attention (bf16) ---------------------------------------------------
// One request's new tokens (positions num_cached .. seq_len-1) attend causally over its keys in
// the paged cache (the new ones already written). Flash-style, per KV head and block of up to 16
// query positions: the block's R = 16 x G query rows (G heads share the KV head) go through the
// keys 32 at a time with an online softmax; nothing [L, L]-sized is materialized. Each chunk's
// keys and values are widened to fp32 once, then shared by all R rows. As the AVX-512 set:
// probabilities are rounded to bf16 before P @ V, the denominator sums them unrounded.

constexpr int kPrefillKeys = 32;  // keys per chunk (a multiple of 4)

// Per-thread scratch, sized for R rows (rounded up to 4) and head_dim D.
struct PrefillScratch {
  std::vector<float> q, k, v, s, acc, row_max, row_sum, corr;
  std::vector<int32_t> pos, lo;  // per row: its position and first visible key
  void size_for(int64_t rows, int64_t d) {
    q.resize(rows * d), acc.resize(rows * d), s.resize(rows * kPrefillKeys);
    k.resize(kPrefillKeys * d), v.resize(kPrefillKeys * d);
    row_max.resize(rows), row_sum.resize(rows), corr.resize(rows), pos.resize(rows), lo.resize(rows);
  }
};

inline void widen_row(const uint16_t* src, float* dst, int64_t d) {
  for (int64_t i = 0; i < d; i += 4) vst1q_f32(dst + i, load_bf16(src + i));
}

// s[r][k] = q_r . k_k for rows r0 .. r0 + 3 and keys k0 .. k0 + 3 (4 x 4 accumulators over the
// head's dims, then a pairwise reduction per row).
template <int CH>
inline void score_tile(const float* q, const float* k, float* s) {
  constexpr int D = 16 * CH;
  float32x4_t acc[4][4];
  for (int i = 0; i < 4; ++i)
    for (int j = 0; j < 4; ++j) acc[i][j] = vdupq_n_f32(0.f);
  for (int d = 0; d < D; d += 4) {
    float32x4_t kv[4];
    for (int j = 0; j < 4; ++j) kv[j] = vld1q_f32(k + j * D + d);
    for (int i = 0; i < 4; ++i) {
      const float32x4_t qv = vld1q_f32(q + i * D + d);
      for (int j = 0; j < 4; ++j) acc[i][j] = vfmaq_f32(acc[i][j], qv, kv[j]);
    }
  }
  for (int i = 0; i < 4; ++i)
    vst1q_f32(s + i * kPrefillKeys,
              vpaddq_f32(vpaddq_f32(acc[i][0], acc[i][1]), vpaddq_f32(acc[i][2], acc[i][3])));
}

// One row's chunk of scores (keys t0 .. t0 + n_keys - 1): masked and scaled, the new running max,
// the old sums' factor, and the probabilities (bf16-rounded, in place; 0 where masked).
inline void online_softmax_row(float* s, int64_t t0, int n_keys, int32_t pos, int32_t lo, float scale,
                               float& row_max, float& row_sum, float& corr) {
  const int32_t idx[4] = {0, 1, 2, 3};
  const int32x4_t lane = vld1q_s32(idx);
  const float32x4_t neg_inf = vdupq_n_f32(-INFINITY);
  uint32x4_t valid[kPrefillKeys / 4];
  float32x4_t mx = neg_inf;
  for (int c = 0; c < kPrefillKeys / 4; ++c) {
    const int32x4_t t = vaddq_s32(lane, vdupq_n_s32((int32_t)t0 + 4 * c));
    valid[c] = vandq_u32(vandq_u32(vcleq_s32(t, vdupq_n_s32(pos)), vcgeq_s32(t, vdupq_n_s32(lo))),
                         first_lanes(n_keys - 4 * c));
    const float32x4_t sk = vbslq_f32(valid[c], vmulq_n_f32(vld1q_f32(s + 4 * c), scale), neg_inf);
    vst1q_f32(s + 4 * c, sk);
    mx = vmaxq_f32(mx, sk);
  }
  const float m_old = row_max, m_new = std::max(m_old, vmaxvq_f32(mx));
  const float base = m_new == -INFINITY ? 0.f : m_new;  // no key seen yet: keep -inf, make no NaN
  corr = vgetq_lane_f32(exp_nonpositive(vdupq_n_f32(m_old - base)), 0);
  float32x4_t sum = vdupq_n_f32(0.f);
  for (int c = 0; c < kPrefillKeys / 4; ++c) {
    const float32x4_t e = exp_nonpositive(vsubq_f32(vld1q_f32(s + 4 * c), vdupq_n_f32(base)));
    const float32x4_t p = vbslq_f32(valid[c], e, vdupq_n_f32(0.f));
    sum = vaddq_f32(sum, p);
    vst1q_f32(s + 4 * c, round_bf16(p));
  }
  row_max = m_new;
  row_sum = row_sum * corr + vaddvq_f32(sum);
}

// acc[r] = acc[r] * corr[r] + sum over the chunk's keys of p[r][k] v[k], rows r0 .. r0 + 3,
// 16 dims at a time (16 accumulators).
template <int CH>
inline void weigh_values(float* acc, const float* corr, const float* p, const float* v, int n_keys) {
  constexpr int D = 16 * CH;
  for (int c = 0; c < CH; ++c) {
    float32x4_t sum[4][4];
    for (int i = 0; i < 4; ++i)
      for (int j = 0; j < 4; ++j) sum[i][j] = vmulq_n_f32(vld1q_f32(acc + i * D + 16 * c + 4 * j), corr[i]);
    for (int k = 0; k < n_keys; ++k) {
      float32x4_t vv[4];
      for (int j = 0; j < 4; ++j) vv[j] = vld1q_f32(v + k * D + 16 * c + 4 * j);
      for (int i = 0; i < 4; ++i) {
        const float pk = p[i * kPrefillKeys + k];
        for (int j = 0; j < 4; ++j) sum[i][j] = vfmaq_n_f32(sum[i][j], vv[j], pk);
      }
    }
    for (int i = 0; i < 4; ++i)
      for (int j = 0; j < 4; ++j) vst1q_f32(acc + i * D + 16 * c + 4 * j, sum[i][j]);
  }
}

template <int CH>
void prefill_block(const PrefillArgs& a, const uint16_t* q, const uint16_t* kc, const uint16_t* vc,
                   const int64_t* table, int64_t h, int64_t i0, int64_t nq, PrefillScratch& w, uint16_t* out,
                   int64_t out_stride) {
  constexpr int64_t D = 16 * CH;
  const int64_t g_n = a.group, rows = nq * g_n, rows4 = (rows + 3) / 4 * 4;
  const int64_t p_first = a.num_cached + i0, p_last = p_first + nq - 1;
  const int64_t lo_first = a.window > 0 ? std::max<int64_t>(0, p_first - a.window + 1) : 0;
  // query rows r = i * G + g widened; padding rows are zero, see no key, and are never written out
  for (int64_t r = 0; r < rows4; ++r) {
    if (r < rows) {
      widen_row(q + (i0 + r / g_n) * a.q_stride_tok + (h * g_n + r % g_n) * a.q_stride_head, &w.q[r * D], D);
      const int64_t p = p_first + r / g_n;
      w.pos[r] = (int32_t)p;
      w.lo[r] = a.window > 0 ? (int32_t)std::max<int64_t>(0, p - a.window + 1) : 0;
    } else {
      std::fill(&w.q[r * D], &w.q[r * D] + D, 0.f);
      w.corr[r] = 1.f;
    }
    w.row_max[r] = -INFINITY, w.row_sum[r] = 0.f;
  }
  std::fill(w.acc.begin(), w.acc.begin() + rows4 * D, 0.f);
  const uint16_t* rows_at[kPrefillKeys];
  for (int64_t t0 = lo_first; t0 <= p_last; t0 += kPrefillKeys) {
    const int n_keys = (int)std::min<int64_t>(kPrefillKeys, p_last + 1 - t0), n4 = (n_keys + 3) / 4 * 4;
    token_rows(kc, table, a.block_size, a.cache_stride_block, a.cache_stride_token, t0, n_keys, rows_at);
    for (int k = 0; k < n4; ++k) {
      if (k < n_keys) widen_row(rows_at[k] + h * D, &w.k[k * D], D);
      else std::fill(&w.k[k * D], &w.k[k * D] + D, 0.f);
    }
    token_rows(vc, table, a.block_size, a.cache_stride_block, a.cache_stride_token, t0, n_keys, rows_at);
    for (int k = 0; k < n_keys; ++k) widen_row(rows_at[k] + h * D, &w.v[k * D], D);
    for (int64_t r = 0; r < rows4; r += 4)
      for (int k = 0; k < n4; k += 4) score_tile<CH>(&w.q[r * D], &w.k[k * D], &w.s[r * kPrefillKeys + k]);
    for (int64_t r = 0; r < rows && a.softcap > 0.f; ++r)
      softcap_scores(&w.s[r * kPrefillKeys], n_keys, a.scale, a.softcap);
    for (int64_t r = 0; r < rows; ++r)
      online_softmax_row(&w.s[r * kPrefillKeys], t0, n_keys, w.pos[r], w.lo[r], a.scale, w.row_max[r],
                         w.row_sum[r], w.corr[r]);
    if (rows < rows4)  // padding rows: no probabilities (their scores above were of zero queries)
      std::fill(w.s.data() + rows * kPrefillKeys, w.s.data() + rows4 * kPrefillKeys, 0.f);
    for (int64_t r = 0; r < rows4; r += 4)
      weigh_values<CH>(&w.acc[r * D], &w.corr[r], &w.s[r * kPrefillKeys], w.v.data(), n_keys);
  }
  for (int64_t r = 0; r < rows; ++r) {
    const float inv = 1.f / w.row_sum[r];
    uint16_t* o = out + (i0 + r / g_n) * out_stride + (h * g_n + r % g_n) * D;
    for (int64_t d = 0; d < D; d += 4) store_bf16(o + d, vmulq_n_f32(vld1q_f32(&w.acc[r * D + d]), inv));
  }
}

template <int CH>
struct Prefill {
  static constexpr auto run = prefill_block<CH>;
};
using PrefillFn = decltype(&prefill_block<2>);

void prefill_attention(const PrefillArgs& a, const uint16_t* q, const uint16_t* kc, const uint16_t* vc,
                       const int64_t* table, int64_t num_kv_heads, int64_t lq, uint16_t* out, int64_t out_stride) {
  const int64_t q_blocks = (lq + 15) / 16;
  const PrefillFn fn = for_head_dim<PrefillFn, Prefill>(a.head_dim);
  // Later query blocks see more keys (causal): order them first, last, second, second to
  // last, ... so that each thread's contiguous share of items carries about the same work.
  parallel_for(0, q_blocks * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    thread_local PrefillScratch scratch;
    scratch.size_for((16 * a.group + 3) / 4 * 4, a.head_dim);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t k = item / num_kv_heads, h = item % num_kv_heads;
      const int64_t qb = k % 2 == 0 ? k / 2 : q_blocks - 1 - k / 2;
      const int64_t i0 = qb * 16;
      fn(a, q, kc, vc, table, h, i0, std::min<int64_t>(16, lq - i0), scratch, out, out_stride);
    }
  });
}

}  // namespace kvserve::neon
