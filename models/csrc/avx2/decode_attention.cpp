// Paged decode attention on AVX2 + FMA: one query token per request over the paged KV cache.
// Two passes over the keys per (request, KV heads) item: scores for the G query heads sharing
// each KV head (kept in a scratch row per query head), then softmax and the weighted sum of
// values. Without bf16 dot products, bf16 is widened to fp32 in registers: a 32-bit lane of
// bf16 pairs gives its even dim with a shift and its odd dim with a mask, so 16 dims cost one
// load and two integer ops. Queries and accumulators are kept in that "pair order" (per 16
// dims: the 8 even ones, then the 8 odd ones) and put back in natural order on the way out.
#include "avx2.h"

namespace kvserve::avx2 {
namespace {

inline __m256 even_dims(__m256i x) { return _mm256_castsi256_ps(_mm256_slli_epi32(x, 16)); }
inline __m256 odd_dims(__m256i x) {
  return _mm256_castsi256_ps(_mm256_and_si256(x, _mm256_set1_epi32((int)0xFFFF0000u)));
}
inline __m256i load16(const uint16_t* p) { return _mm256_loadu_si256((const __m256i*)p); }

// v[i] summed across its 8 lanes, for i = 0..7, as one vector (lane i = sum of v[i]): a
// transpose-and-add tree instead of 8 horizontal reductions.
inline __m256 sum_each8(const __m256* v) {
  __m256 p[4];
  for (int i = 0; i < 4; ++i)  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
    p[i] = _mm256_add_ps(_mm256_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm256_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  __m256 q[2];
  for (int i = 0; i < 2; ++i) {  // per 128-bit lane: that half's sums of 4 vectors
    const __m256d x = _mm256_castps_pd(p[2 * i]), y = _mm256_castps_pd(p[2 * i + 1]);
    q[i] = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(x, y)), _mm256_castpd_ps(_mm256_unpackhi_pd(x, y)));
  }
  return _mm256_add_ps(_mm256_permute2f128_ps(q[0], q[1], 0x20), _mm256_permute2f128_ps(q[0], q[1], 0x31));
}

// s[g * s_stride + i] = q_g . key i for 16 keys and GB (1 or 2) query rows (qf: pair order,
// rows d apart). Each key chunk is widened once for both rows; the partial sums of 8 (row,
// key) pairs at a time are reduced together.
template <int GB>
inline void score16(const float* qf, int64_t d, const uint16_t* const* keys, int64_t head_off, float* s,
                    int64_t s_stride) {
  constexpr int NK = 8 / GB;
  for (int k0 = 0; k0 < 16; k0 += NK) {
    __m256 acc[GB * NK];
    for (int i = 0; i < GB * NK; ++i) acc[i] = _mm256_setzero_ps();
    for (int64_t c = 0; c < d; c += 16)
      for (int i = 0; i < NK; ++i) {
        const __m256i x = load16(keys[k0 + i] + head_off + c);
        const __m256 ev = even_dims(x), od = odd_dims(x);
        for (int g = 0; g < GB; ++g) {
          acc[g * NK + i] = _mm256_fmadd_ps(_mm256_loadu_ps(qf + g * d + c), ev, acc[g * NK + i]);
          acc[g * NK + i] = _mm256_fmadd_ps(_mm256_loadu_ps(qf + g * d + c + 8), od, acc[g * NK + i]);
        }
      }
    const __m256 sums = sum_each8(acc);  // lane g * NK + i
    if constexpr (GB == 1) {
      _mm256_storeu_ps(s + k0, sums);
    } else {
      _mm_storeu_ps(s + k0, _mm256_castps256_ps128(sums));
      _mm_storeu_ps(s + s_stride + k0, _mm256_extractf128_ps(sums, 1));
    }
  }
}

// acc rows (pair order, d apart) += sum over n tokens of p[g * p_stride + t] * v[t], GB rows
// and 16 dims at a time in registers: each value chunk is widened once for all GB rows.
template <int GB>
inline void accumulate(float* acc, int64_t d, const float* p, int64_t p_stride, const uint16_t* const* values,
                       int64_t head_off, int n) {
  for (int64_t c = 0; c < d; c += 16) {
    __m256 s[GB][2];
    for (int g = 0; g < GB; ++g)
      for (int k = 0; k < 2; ++k) s[g][k] = _mm256_loadu_ps(acc + g * d + c + 8 * k);
    for (int t = 0; t < n; ++t) {
      const __m256i x = load16(values[t] + head_off + c);
      const __m256 ev = even_dims(x), od = odd_dims(x);
      for (int g = 0; g < GB; ++g) {
        const __m256 pb = _mm256_broadcast_ss(p + g * p_stride + t);
        s[g][0] = _mm256_fmadd_ps(pb, ev, s[g][0]);
        s[g][1] = _mm256_fmadd_ps(pb, od, s[g][1]);
      }
    }
    for (int g = 0; g < GB; ++g)
      for (int k = 0; k < 2; ++k) _mm256_storeu_ps(acc + g * d + c + 8 * k, s[g][k]);
  }
}

// Rows per register block when `left` rows remain: up to `most`, balanced (9 -> 3 + 3 + 3).
inline int row_block(int64_t left, int64_t most) {
  const int64_t blocks = (left + most - 1) / most;
  return (int)((left + blocks - 1) / blocks);
}

// One pair-order row times inv, written as bf16 in natural order.
inline void store_row(const float* acc, int64_t d, float inv, uint16_t* out) {
  const __m256 scale = _mm256_set1_ps(inv);
  for (int64_t c = 0; c < d; c += 16) {
    const __m256 e = _mm256_mul_ps(_mm256_loadu_ps(acc + c), scale);
    const __m256 o = _mm256_mul_ps(_mm256_loadu_ps(acc + c + 8), scale);
    const __m256 lo = _mm256_unpacklo_ps(e, o), hi = _mm256_unpackhi_ps(e, o);  // per 128 bits: dims 0-3, 4-7
    store_bf16(out + c, _mm256_permute2f128_ps(lo, hi, 0x20));
    store_bf16(out + c + 8, _mm256_permute2f128_ps(lo, hi, 0x31));
  }
}

// Scores of one row (len of them) -> scaled (+ bias), then exp(x - max) rounded to bf16 in
// place (kept as fp32); returns the denominator, the sum of the unrounded values.
inline float softmax_row(float* row, int64_t len, float scale, const float* bias) {
  const __m256 sc = _mm256_set1_ps(scale), neg_inf = _mm256_set1_ps(-INFINITY);
  const int64_t full = len / 8 * 8;
  const __m256i tail =  // lanes of the last, partial vector
      _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(len - full)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  __m256 mx = neg_inf;
  for (int64_t i = 0; i < full; i += 8) {
    __m256 x = _mm256_mul_ps(_mm256_loadu_ps(row + i), sc);
    if (bias) x = _mm256_add_ps(x, _mm256_loadu_ps(bias + i));
    _mm256_storeu_ps(row + i, x);
    mx = _mm256_max_ps(mx, x);
  }
  if (full < len) {
    __m256 x = _mm256_mul_ps(_mm256_maskload_ps(row + full, tail), sc);
    if (bias) x = _mm256_add_ps(x, _mm256_maskload_ps(bias + full, tail));
    _mm256_maskstore_ps(row + full, tail, x);
    mx = _mm256_max_ps(mx, _mm256_blendv_ps(neg_inf, x, _mm256_castsi256_ps(tail)));
  }
  const __m256 row_max = _mm256_set1_ps(hmax(mx));
  __m256 sum = _mm256_setzero_ps();
  for (int64_t i = 0; i < full; i += 8) {
    const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(row + i), row_max));
    sum = _mm256_add_ps(sum, e);
    _mm256_storeu_ps(row + i, round_finite_bf16(e));
  }
  if (full < len) {
    const __m256 e = _mm256_and_ps(exp_nonpositive(_mm256_sub_ps(_mm256_maskload_ps(row + full, tail), row_max)),
                                   _mm256_castsi256_ps(tail));
    sum = _mm256_add_ps(sum, e);
    _mm256_maskstore_ps(row + full, tail, round_finite_bf16(e));
  }
  return hsum(sum);
}

// Token rows t0 .. t0 + n - 1 of a cache, padded to 16 with the first (scored, never used).
inline void rows16(const DecodeArgs& a, const uint16_t* cache, const int64_t* table, int64_t t0, int n,
                   const uint16_t** rows) {
  token_rows(cache, table, a.block_size, a.cache_stride_block, a.cache_stride_token, t0, n, rows);
  for (int i = n; i < 16; ++i) rows[i] = rows[0];
}

struct Scratch {
  std::vector<float> qf, scores, acc, denom;
};

// One item: KV heads [h0, h1) of one request over keys [start, end); q and out point at the
// request. The cache rows are fetched into L2 a group ahead of their use, spread between the
// score and value calls (RowPrefetcher): this group's values and the next group's keys in pass 1
// (unless the previous item fetched this one's keys), the next item's keys in pass 2.
void attend(const DecodeArgs& a, const uint16_t* q, const uint16_t* kc, const uint16_t* vc, const DecodeItem& it,
            const DecodeItem* next, bool keys_prefetched, Scratch& w, uint16_t* out) {
  const int64_t* table = it.table;
  const int64_t start = it.start, end = it.end, h0 = it.h0, h1 = it.h1;
  const int64_t len = end - start, g_n = a.group, d = a.head_dim;
  const int64_t rows = (h1 - h0) * g_n, row_stride = decode_row_stride(len);
  w.qf.resize(rows * d), w.acc.assign(rows * d, 0.f), w.denom.resize(rows);
  w.scores.resize(rows * row_stride);
  for (int64_t r = 0; r < rows; ++r) {  // queries widened once, into pair order
    const uint16_t* qr = q + (h0 * g_n + r) * a.q_stride_head;
    for (int64_t c = 0; c < d; c += 16) {
      const __m256i x = load16(qr + c);
      _mm256_storeu_ps(&w.qf[r * d + c], even_dims(x));
      _mm256_storeu_ps(&w.qf[r * d + c + 8], odd_dims(x));
    }
  }
  const uint16_t* tokens[16];
  RowPrefetcher values_pf, keys_pf;
  const int score_calls = (int)((h1 - h0) * ((g_n + 1) / 2));
  for (int64_t t0 = start; t0 < end; t0 += 16) {
    const int n = (int)std::min<int64_t>(16, end - t0);
    rows16(a, kc, table, t0, n, tokens);
    values_pf.start_tokens(a, vc, table, t0, end, h0, h1);
    if (!keys_prefetched) keys_pf.start_tokens(a, kc, table, t0 + 16, end, h0, h1);
    const int per_call = (values_pf.lines_left() + keys_pf.lines_left() + score_calls - 1) / score_calls;
    for (int64_t h = h0; h < h1; ++h)
      for (int64_t g = 0; g < g_n;) {
        values_pf.issue(per_call);
        keys_pf.issue(per_call);
        const int gb = g + 1 < g_n ? 2 : 1;
        const int64_t r = (h - h0) * g_n + g;
        float* s = &w.scores[r * row_stride + (t0 - start)];
        const float* qf = &w.qf[r * d];
        if (gb == 2) score16<2>(qf, d, tokens, h * d, s, row_stride);
        else score16<1>(qf, d, tokens, h * d, s, row_stride);
        g += gb;
      }
  }
  for (int64_t r = 0; r < rows; ++r) {
    if (a.softcap > 0.f) softcap_scores(&w.scores[r * row_stride], len, a.scale, a.softcap);
    const float* bias = a.bias ? a.bias + (h0 * g_n + r) * a.bias_stride + (a.bias_len - end + start) : nullptr;
    w.denom[r] = softmax_row(&w.scores[r * row_stride], len, a.scale, bias);
  }
  for (int64_t t0 = start; t0 < end; t0 += 16) {
    const int n = (int)std::min<int64_t>(16, end - t0);
    rows16(a, vc, table, t0, n, tokens);
    keys_pf.n_rows = 0;
    if (next) keys_pf.start_tokens(a, kc, next->table, next->start + (t0 - start), next->end, next->h0, next->h1);
    const int per_call = (keys_pf.lines_left() + (int)(h1 - h0) - 1) / (int)(h1 - h0);
    for (int64_t h = h0; h < h1; ++h) {
      keys_pf.issue(per_call);
      for (int64_t g = 0; g < g_n;) {
        const int gb = row_block(g_n - g, 4);
        const int64_t r = (h - h0) * g_n + g;
        const float* p = &w.scores[r * row_stride + (t0 - start)];
        float* acc = &w.acc[r * d];
        if (gb == 4) accumulate<4>(acc, d, p, row_stride, tokens, h * d, n);
        else if (gb == 3) accumulate<3>(acc, d, p, row_stride, tokens, h * d, n);
        else if (gb == 2) accumulate<2>(acc, d, p, row_stride, tokens, h * d, n);
        else accumulate<1>(acc, d, p, row_stride, tokens, h * d, n);
        g += gb;
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) store_row(&w.acc[r * d], d, 1.f / w.denom[r], out + (h0 * g_n + r) * d);
}

}  // namespace

void decode_attention(const DecodeArgs& a, const uint16_t* q, const uint16_t* kc, const uint16_t* vc,
                      const int64_t* table, const int64_t* seq_lens, int64_t num_reqs, uint16_t* out) {
  // Enough requests to share out: one work item per request (all its KV heads, reading
  // each cached token's heads together); otherwise one per (request, KV head).
  const int64_t heads_per_item = a.num_kv_heads > 1 && num_reqs < 2 * num_threads() ? 1 : a.num_kv_heads;
  const int64_t items_per_req = a.num_kv_heads / heads_per_item;
  const int64_t items = num_reqs * items_per_req;
  auto item_at = [&](int64_t item) {
    const int64_t b = item / items_per_req, h0 = item % items_per_req * heads_per_item, seq_len = seq_lens[b];
    const int64_t start = a.window > 0 ? std::max<int64_t>(0, seq_len - a.window) : 0;
    return DecodeItem{table + b * a.table_stride, start, seq_len, h0, h0 + heads_per_item};
  };
  parallel_items(items, [&](ItemQueue& queue) {
    Scratch w;
    int64_t last = -2;
    for (int64_t item; queue.next(&item);) {
      const int64_t b = item / items_per_req;
      // a thread mostly runs its share in order: fetch the next item's keys during pass 2 (a
      // stolen item's only waste some prefetches)
      const DecodeItem it = item_at(item), next = item + 1 < items ? item_at(item + 1) : DecodeItem{};
      attend(a, q + b * a.q_stride_req, kc, vc, it, item + 1 < items ? &next : nullptr, item == last + 1, w,
             out + b * a.num_kv_heads * a.group * a.head_dim);
      last = item;
    }
  });
}

}  // namespace kvserve::avx2
