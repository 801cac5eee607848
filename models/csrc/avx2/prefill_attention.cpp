// Paged prefill attention on AVX2 + FMA: one request's new tokens (positions num_cached ..
// seq_len - 1) attend causally (within the window, if any) over its keys in the paged cache.
// Flash-style, per KV head and block of up to 16 query positions: the block's R = 16 x G query
// rows (the G heads sharing the KV head) go through the keys 32 at a time with an online
// softmax; nothing [L, L]-sized is materialized. Each chunk's keys and values are widened to
// fp32 once (their cost is shared by all R rows), then both products are vertical:
//  * scores S^T [keys, rows], lane = query row: queries transposed once per block to
//    [dims, rows]; each key's dim is broadcast against 8 rows at a time, so the row max and
//    sum are plain vector operations across keys, with no horizontal reduction.
//  * P V: probabilities rounded to bf16 (as PyTorch's CPU SDPA does before its P @ V; the
//    denominator sums them unrounded), each broadcast over a value row's dims.
#include "avx2.h"

namespace kvserve::avx2 {
namespace {

constexpr int kKeys = 32;  // keys per chunk

struct Scratch {
  std::vector<float> qt, kf, vf, s, acc, row_max, row_sum, corr;
  std::vector<int32_t> pos, lo;  // per lane: its position and first visible key
  void size_for(int64_t lanes, int64_t d) {
    qt.resize(d * lanes), kf.resize(kKeys * d), vf.resize(kKeys * d), s.resize(kKeys * lanes);
    acc.resize(lanes * d), row_max.resize(lanes), row_sum.resize(lanes), corr.resize(lanes);
    pos.resize(lanes), lo.resize(lanes);
  }
};

// s[k * lanes + lane] = key k . query lane, for NK keys (kf rows, d apart) and NC 8-lane
// columns from c0: NK x NC accumulators over the dims, the queries' column in registers.
template <int NK, int NC>
inline void score_strip(const float* qt, int64_t lanes, int64_t c0, const float* kf, int64_t d, float* s) {
  __m256 acc[NK][NC];
  for (int k = 0; k < NK; ++k)
    for (int c = 0; c < NC; ++c) acc[k][c] = _mm256_setzero_ps();
  for (int64_t j = 0; j < d; ++j) {
    __m256 qv[NC];
    for (int c = 0; c < NC; ++c) qv[c] = _mm256_loadu_ps(qt + j * lanes + (c0 + c) * 8);
    for (int k = 0; k < NK; ++k) {
      const __m256 kb = _mm256_broadcast_ss(kf + k * d + j);
      for (int c = 0; c < NC; ++c) acc[k][c] = _mm256_fmadd_ps(kb, qv[c], acc[k][c]);
    }
  }
  for (int k = 0; k < NK; ++k)
    for (int c = 0; c < NC; ++c) _mm256_storeu_ps(s + k * lanes + (c0 + c) * 8, acc[k][c]);
}

// acc rows r0 .. r0 + GB - 1 = acc * corr + sum over n keys of p[k * lanes + r] * v[k], 16
// dims of GB rows at a time in registers.
template <int GB>
inline void accumulate(float* acc, int64_t r0, int64_t d, const float* corr, const float* p, int64_t lanes,
                       const float* vf, int n) {
  for (int64_t c = 0; c < d; c += 16) {
    __m256 s[GB][2];
    for (int g = 0; g < GB; ++g) {
      const __m256 cr = _mm256_broadcast_ss(corr + r0 + g);
      for (int k = 0; k < 2; ++k) s[g][k] = _mm256_mul_ps(_mm256_loadu_ps(acc + (r0 + g) * d + c + 8 * k), cr);
    }
    for (int t = 0; t < n; ++t) {
      const __m256 v0 = _mm256_loadu_ps(vf + t * d + c), v1 = _mm256_loadu_ps(vf + t * d + c + 8);
      for (int g = 0; g < GB; ++g) {
        const __m256 pb = _mm256_broadcast_ss(p + t * lanes + r0 + g);
        s[g][0] = _mm256_fmadd_ps(pb, v0, s[g][0]);
        s[g][1] = _mm256_fmadd_ps(pb, v1, s[g][1]);
      }
    }
    for (int g = 0; g < GB; ++g)
      for (int k = 0; k < 2; ++k) _mm256_storeu_ps(acc + (r0 + g) * d + c + 8 * k, s[g][k]);
  }
}

// n token rows (head offset applied) -> fp32 rows d apart; rows n .. n_pad - 1 zero.
inline void widen_rows(const uint16_t* const* rows, int64_t head_off, int n, int n_pad, int64_t d, float* dst) {
  for (int k = 0; k < n; ++k)
    for (int64_t c = 0; c < d; c += 8) _mm256_storeu_ps(dst + k * d + c, load_bf16(rows[k] + head_off + c));
  std::fill(dst + n * d, dst + n_pad * d, 0.f);
}

// Online-softmax step for one 8-lane column c over the chunk's n keys from t0: mask (unless
// every key is visible to every row), new max, rescale factor, probabilities (bf16-rounded,
// in place of the scores).
inline void softmax_column(Scratch& w, int64_t c, int64_t lanes, int64_t t0, int n, float scale, bool all_visible) {
  const __m256 sc = _mm256_set1_ps(scale), neg_inf = _mm256_set1_ps(-INFINITY);
  float* s = &w.s[8 * c];
  const __m256 m_old = _mm256_loadu_ps(&w.row_max[8 * c]);
  __m256 mx = m_old;
  if (all_visible) {
    for (int k = 0; k < n; ++k) {
      const __m256 sk = _mm256_mul_ps(_mm256_loadu_ps(s + k * lanes), sc);
      _mm256_storeu_ps(s + k * lanes, sk);
      mx = _mm256_max_ps(mx, sk);
    }
  } else {
    const __m256i pc = _mm256_loadu_si256((const __m256i*)&w.pos[8 * c]);
    const __m256i lc = _mm256_loadu_si256((const __m256i*)&w.lo[8 * c]);
    for (int k = 0; k < n; ++k) {
      const __m256i t = _mm256_set1_epi32((int)(t0 + k));
      const __m256i hidden = _mm256_or_si256(_mm256_cmpgt_epi32(t, pc), _mm256_cmpgt_epi32(lc, t));
      const __m256 sk = _mm256_blendv_ps(_mm256_mul_ps(_mm256_loadu_ps(s + k * lanes), sc), neg_inf,
                                         _mm256_castsi256_ps(hidden));
      _mm256_storeu_ps(s + k * lanes, sk);
      mx = _mm256_max_ps(mx, sk);
    }
  }
  // rows that have seen no key yet keep -inf; subtract 0 there so nothing becomes NaN
  // (exp of -inf is 0 here: exp_nonpositive clamps its input and zeroes what underflows)
  const __m256 base = _mm256_blendv_ps(mx, _mm256_setzero_ps(), _mm256_cmp_ps(mx, neg_inf, _CMP_EQ_OQ));
  const __m256 corr = exp_nonpositive(_mm256_sub_ps(m_old, base));
  __m256 sum = _mm256_mul_ps(_mm256_loadu_ps(&w.row_sum[8 * c]), corr);
  for (int k = 0; k < n; ++k) {
    const __m256 p = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(s + k * lanes), base));
    sum = _mm256_add_ps(sum, p);
    _mm256_storeu_ps(s + k * lanes, round_finite_bf16(p));
  }
  _mm256_storeu_ps(&w.row_max[8 * c], mx);
  _mm256_storeu_ps(&w.row_sum[8 * c], sum);
  _mm256_storeu_ps(&w.corr[8 * c], corr);
}

// KV head h, query positions i0 .. i0 + nq - 1 (of the lq new ones).
void prefill_block(const PrefillArgs& a, const uint16_t* q, const uint16_t* kc, const uint16_t* vc,
                   const int64_t* table, int64_t h, int64_t i0, int64_t nq, Scratch& w, uint16_t* out,
                   int64_t out_stride) {
  const int64_t g_n = a.group, d = a.head_dim, rows = nq * g_n, cols = (rows + 7) / 8, lanes = cols * 8;
  const int64_t p_first = a.num_cached + i0, p_last = p_first + nq - 1;
  const int64_t lo_first = a.window > 0 ? std::max<int64_t>(0, p_first - a.window + 1) : 0;
  // queries transposed to [dims, lanes], lane = row r = i * G + g (padding lanes zero); each
  // lane's position and first visible key (padding lanes see nothing)
  float* qt = w.qt.data();
  for (int64_t r = 0; r < lanes; ++r) {
    const int64_t p = r < rows ? p_first + r / g_n : -1;
    w.pos[r] = (int32_t)p;
    w.lo[r] = r < rows && a.window > 0 ? (int32_t)std::max<int64_t>(0, p - a.window + 1) : 0;
    if (r >= rows) {
      for (int64_t j = 0; j < d; ++j) qt[j * lanes + r] = 0.f;
      continue;
    }
    const uint16_t* qr = q + (i0 + r / g_n) * a.q_stride_tok + (h * g_n + r % g_n) * a.q_stride_head;
    for (int64_t j = 0; j < d; ++j) qt[j * lanes + r] = bf16_to_float(qr[j]);
  }
  std::fill(w.acc.begin(), w.acc.begin() + lanes * d, 0.f);
  std::fill(w.row_max.begin(), w.row_max.begin() + lanes, -INFINITY);
  std::fill(w.row_sum.begin(), w.row_sum.begin() + lanes, 0.f);
  const uint16_t* keys[kKeys];
  const uint16_t* values[kKeys];
  for (int64_t t0 = lo_first; t0 <= p_last; t0 += kKeys) {
    const int n = (int)std::min<int64_t>(kKeys, p_last + 1 - t0), n2 = (n + 1) / 2 * 2;
    token_rows(kc, table, a.block_size, a.cache_stride_block, a.cache_stride_token, t0, n, keys);
    token_rows(vc, table, a.block_size, a.cache_stride_block, a.cache_stride_token, t0, n, values);
    widen_rows(keys, h * d, n, n2, d, w.kf.data());
    widen_rows(values, h * d, n, n, d, w.vf.data());
    // strips of 6 keys x 2 columns: 12 accumulators, 2 query vectors and a broadcast fill the
    // 16 registers (a padded key, to an even count, scores 0 and is never read)
    for (int64_t c = 0; c < cols;) {
      const float* kf = w.kf.data();
      float* s = w.s.data();
      if (c + 2 <= cols) {
        int k = 0;
        for (; k + 6 <= n2; k += 6) score_strip<6, 2>(qt, lanes, c, kf + k * d, d, s + k * lanes);
        for (; k < n2; k += 2) score_strip<2, 2>(qt, lanes, c, kf + k * d, d, s + k * lanes);
        c += 2;
      } else {
        for (int k = 0; k < n2; k += 2) score_strip<2, 1>(qt, lanes, c, kf + k * d, d, s + k * lanes);
        c += 1;
      }
    }
    // chunks every row sees in full skip the mask (padding lanes then score zeros, unused)
    const bool all_visible = t0 + n - 1 <= p_first && t0 >= w.lo[rows - 1];
    if (a.softcap > 0.f) softcap_scores(w.s.data(), n * lanes, a.scale, a.softcap);
    for (int64_t c = 0; c < cols; ++c) softmax_column(w, c, lanes, t0, n, a.scale, all_visible);
    for (int64_t r0 = 0; r0 < rows;) {
      const int64_t gb = std::min<int64_t>(6, rows - r0);
      const float *cr = w.corr.data(), *p = w.s.data(), *vf = w.vf.data();
      switch (gb) {
        case 6: accumulate<6>(w.acc.data(), r0, d, cr, p, lanes, vf, n); break;
        case 5: accumulate<5>(w.acc.data(), r0, d, cr, p, lanes, vf, n); break;
        case 4: accumulate<4>(w.acc.data(), r0, d, cr, p, lanes, vf, n); break;
        case 3: accumulate<3>(w.acc.data(), r0, d, cr, p, lanes, vf, n); break;
        case 2: accumulate<2>(w.acc.data(), r0, d, cr, p, lanes, vf, n); break;
        default: accumulate<1>(w.acc.data(), r0, d, cr, p, lanes, vf, n); break;
      }
      r0 += gb;
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const __m256 inv = _mm256_set1_ps(1.f / w.row_sum[r]);
    uint16_t* o = out + (i0 + r / g_n) * out_stride + (h * g_n + r % g_n) * d;
    for (int64_t c = 0; c < d; c += 8) store_bf16(o + c, _mm256_mul_ps(_mm256_loadu_ps(&w.acc[r * d + c]), inv));
  }
}

}  // namespace

void prefill_attention(const PrefillArgs& a, const uint16_t* q, const uint16_t* kc, const uint16_t* vc,
                       const int64_t* table, int64_t num_kv_heads, int64_t lq, uint16_t* out, int64_t out_stride) {
  const int64_t q_blocks = (lq + 15) / 16, lanes = (16 * a.group + 7) / 8 * 8;
  // Later query blocks see more keys (causal): order them first, last, second, second to
  // last, ... so that each thread's contiguous share of items carries about the same work.
  parallel_items(q_blocks * num_kv_heads, [&](ItemQueue& queue) {
    Scratch w;
    w.size_for(lanes, a.head_dim);
    for (int64_t item; queue.next(&item);) {
      const int64_t k = item / num_kv_heads, h = item % num_kv_heads;
      const int64_t qb = k % 2 == 0 ? k / 2 : q_blocks - 1 - k / 2, i0 = qb * 16;
      prefill_block(a, q, kc, vc, table, h, i0, std::min<int64_t>(16, lq - i0), w, out, out_stride);
    }
  });
}

}  // namespace kvserve::avx2
