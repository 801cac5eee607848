// Paged prefill attention: a prompt chunk's causal attention over the paged KV cache (kernels.h).
#include "avx512.h"

namespace kvserve::avx512 {

// ---- paged prefill attention (bf16) ---------------------------------------------------
// One request's new tokens (positions num_cached .. seq_len-1) attend causally over its keys
// in the paged cache (the new ones already written). Flash-style, per KV head and block of
// up to 16 query positions: the block's R = 16 x G query rows (G heads share the KV head)
// go through the keys 32 at a time with an online softmax; nothing [L, L]-sized is ever
// materialized. Both products are shaped like the linear kernel's tile, so neither needs
// a horizontal reduction:
//  * scores S^T [keys, rows]: the queries are packed once per block into dimension pairs
//    (lane = query row), each key's dimension pair is broadcast: one vdpbf16ps scores 16
//    rows. The row max and sum are then plain vertical operations across keys.
//  * P V: probabilities rounded to bf16 (as PyTorch's CPU SDPA does before its P @ V; the
//    denominator sums them unrounded) in key pairs, values interleaved in the same key
//    pairs: one vdpbf16ps does 2 keys x 16 dims for one row.

constexpr int kPrefillKeys = 32;  // keys per chunk (even: probabilities pair up)

// Per-thread scratch of the prefill kernel, sized for R rows (a multiple of 16) and head_dim d.
struct PrefillScratch {
  std::vector<uint32_t> q_pairs, p_pairs, v_pairs;
  std::vector<float> scores, acc, row_max, row_sum, corr;
  std::vector<int32_t> pos, lo;  // per row: its position and first visible key
  void size_for(int64_t rows, int64_t d) {
    pos.resize(rows), lo.resize(rows);
    q_pairs.resize(rows * d / 2);
    scores.resize(kPrefillKeys * rows);
    p_pairs.resize(kPrefillKeys / 2 * rows);
    v_pairs.resize(kPrefillKeys / 2 * d);
    acc.resize(rows * d);
    row_max.resize(rows), row_sum.resize(rows), corr.resize(rows);
  }
};

// s[k][lanes of column c] = q_rows(c) . key k, for NK keys (rows of `keys`) and NC (<= 3)
// 16-row columns from c0: NK x NC accumulators over the head's ch x 8 dimension pairs.
template <int NK, int NC>
KV_AVX512_BF16 inline void score_strip(const uint32_t* q_pairs, int64_t c0, const uint16_t* const* keys,
                                       int64_t head_off, float* s, int64_t s_stride, int64_t ch) {
  __m512 acc[NK][NC];
  for (int k = 0; k < NK; ++k)
    for (int c = 0; c < NC; ++c) acc[k][c] = _mm512_setzero_ps();
  for (int64_t d2 = 0; d2 < ch * 8; ++d2) {
    Pairs qv[NC];
    for (int c = 0; c < NC; ++c) qv[c] = load_pairs(q_pairs + ((c0 + c) * ch * 8 + d2) * 16);
    for (int k = 0; k < NK; ++k) {
      uint32_t pair;
      std::memcpy(&pair, keys[k] + head_off + 2 * d2, sizeof(pair));
      const Pairs kv = as_pairs(_mm512_set1_epi32((int)pair));
      for (int c = 0; c < NC; ++c) acc[k][c] = dot_pairs(acc[k][c], kv, qv[c]);
    }
  }
  for (int k = 0; k < NK; ++k)
    for (int c = 0; c < NC; ++c) _mm512_storeu_ps(s + k * s_stride + (c0 + c) * 16, acc[k][c]);
}

KV_AVX512_BF16 void score_chunk(const uint32_t* q_pairs, int64_t cols, const uint16_t* const* keys, int n_keys,
                                int64_t head_off, float* s, int64_t s_stride, int64_t ch) {
  int k = 0;
  for (; k + 8 <= n_keys; k += 8) {
    int64_t c = 0;
    for (; c + 3 <= cols; c += 3) score_strip<8, 3>(q_pairs, c, keys + k, head_off, s + k * s_stride, s_stride, ch);
    for (; c < cols; ++c) score_strip<8, 1>(q_pairs, c, keys + k, head_off, s + k * s_stride, s_stride, ch);
  }
  for (; k < n_keys; ++k) {
    int64_t c = 0;
    for (; c + 3 <= cols; c += 3) score_strip<1, 3>(q_pairs, c, keys + k, head_off, s + k * s_stride, s_stride, ch);
    for (; c < cols; ++c) score_strip<1, 1>(q_pairs, c, keys + k, head_off, s + k * s_stride, s_stride, ch);
  }
}

// acc[r] = acc[r] * corr[r] + sum over the chunk's key pairs of p pair x value pair, for
// the CW x 16 dims from vector k0 (of ch): GB rows in registers. Only the chunk width is a
// template parameter, so each dim sees the operations of one unbroken row while four
// widths are compiled (not one kernel per head size).
template <int CW>
KV_AVX512_BF16 void pv_chunk(PrefillScratch& w, int64_t rows, int n_pairs, int64_t lanes, int64_t ch, int64_t k0,
                             int64_t d_n) {
  constexpr int GB = (28 - CW) / CW;
  const __m512i* vp = reinterpret_cast<const __m512i*>(w.v_pairs.data()) + k0;
  const uint32_t* pp = w.p_pairs.data();
  float* acc = w.acc.data() + 16 * k0;
  for (int64_t r0 = 0; r0 < rows; r0 += GB) {
    const int gn = (int)std::min<int64_t>(GB, rows - r0);
    __m512 sum[GB][CW];
    for (int g = 0; g < GB; ++g)
      if (g < gn) {
        const __m512 cr = _mm512_set1_ps(w.corr[r0 + g]);
        for (int k = 0; k < CW; ++k) sum[g][k] = _mm512_mul_ps(_mm512_loadu_ps(acc + (r0 + g) * d_n + 16 * k), cr);
      }
    for (int j = 0; j < n_pairs; ++j) {
      Pairs v[CW];
      for (int k = 0; k < CW; ++k) v[k] = load_pairs(vp + j * ch + k);
      for (int g = 0; g < GB; ++g)
        if (g < gn) {
          const Pairs p = as_pairs(_mm512_set1_epi32((int)pp[j * lanes + r0 + g]));
          for (int k = 0; k < CW; ++k) sum[g][k] = dot_pairs(sum[g][k], v[k], p);
        }
    }
    for (int g = 0; g < GB; ++g)
      if (g < gn)
        for (int k = 0; k < CW; ++k) _mm512_storeu_ps(acc + (r0 + g) * d_n + 16 * k, sum[g][k]);
  }
}

KV_AVX512_BF16 void prefill_block_bf16(const PrefillArgs& a, const uint16_t* q, const uint16_t* kc,
                                       const uint16_t* vc, const int64_t* table, int64_t h, int64_t i0, int64_t nq,
                                       PrefillScratch& w, uint16_t* out, int64_t out_stride) {
  const int64_t g_n = a.group, d_n = a.head_dim, ch = d_n / 16, rows = nq * g_n, cols = (rows + 15) / 16, lanes = cols * 16;
  const int64_t p_first = a.num_cached + i0, p_last = p_first + nq - 1;
  const int64_t lo_first = a.window > 0 ? std::max<int64_t>(0, p_first - a.window + 1) : 0;
  // queries into dimension pairs, lane = row r = i * G + g (padding rows zero)
  uint32_t* qp = w.q_pairs.data();
  std::fill(qp, qp + cols * ch * 8 * 16, 0u);
  for (int64_t r = 0; r < rows; ++r) {
    const uint16_t* qr = q + (i0 + r / g_n) * a.q_stride_tok + (h * g_n + r % g_n) * a.q_stride_head;
    for (int64_t d2 = 0; d2 < ch * 8; ++d2) std::memcpy(&qp[((r / 16) * ch * 8 + d2) * 16 + r % 16], qr + 2 * d2, 4);
  }
  // each lane's position and first visible key; padding lanes see nothing
  int32_t* pos = w.pos.data();
  int32_t* lo = w.lo.data();
  for (int64_t r = 0; r < lanes; ++r) {
    const int64_t p = r < rows ? p_first + r / g_n : -1;
    pos[r] = (int32_t)p;
    lo[r] = r < rows && a.window > 0 ? (int32_t)std::max<int64_t>(0, p - a.window + 1) : 0;
  }
  std::fill(w.acc.begin(), w.acc.begin() + lanes * d_n, 0.f);
  std::fill(w.row_max.begin(), w.row_max.begin() + lanes, -INFINITY);
  std::fill(w.row_sum.begin(), w.row_sum.begin() + lanes, 0.f);
  const uint16_t* keys[kPrefillKeys];
  const uint16_t* values[kPrefillKeys];
  float* s = w.scores.data();
  uint32_t* pp = w.p_pairs.data();
  const __m512 scale = _mm512_set1_ps(a.scale), neg_inf = _mm512_set1_ps(-INFINITY);
  for (int64_t t0 = lo_first; t0 <= p_last; t0 += kPrefillKeys) {
    const int n_keys = (int)std::min<int64_t>(kPrefillKeys, p_last + 1 - t0), n_pairs = (n_keys + 1) / 2;
    for (int k = 0; k < n_keys; k += 16) {
      const int n = std::min(16, n_keys - k);
      token_rows(kc, table, a.block_size, a.cache_stride_block, a.cache_stride_token, t0 + k, n, keys + k);
      token_rows(vc, table, a.block_size, a.cache_stride_block, a.cache_stride_token, t0 + k, n, values + k);
    }
    score_chunk(qp, cols, keys, n_keys, h * d_n, s, lanes, ch);
    if (a.softcap > 0.f) softcap_scores(s, n_keys * lanes, a.scale, a.softcap);
    // online softmax per 16-row column: mask, new max, rescale factor, bf16 probability pairs
    for (int64_t c = 0; c < cols; ++c) {
      const __m512i pc = _mm512_loadu_si512(pos + 16 * c), lc = _mm512_loadu_si512(lo + 16 * c);
      __m512 mx = _mm512_loadu_ps(&w.row_max[16 * c]);
      const __m512 m_old = mx;
      for (int k = 0; k < n_keys; ++k) {
        const __m512i t = _mm512_set1_epi32((int)(t0 + k));
        const __mmask16 valid = _mm512_cmple_epi32_mask(t, pc) & _mm512_cmpge_epi32_mask(t, lc);
        const __m512 sk = _mm512_mask_mul_ps(neg_inf, valid, _mm512_loadu_ps(s + k * lanes + 16 * c), scale);
        _mm512_storeu_ps(s + k * lanes + 16 * c, sk);
        mx = _mm512_max_ps(mx, sk);
      }
      // rows that have seen no key yet keep -inf; subtract 0 there so nothing becomes NaN
      const __m512 base = _mm512_mask_mov_ps(mx, _mm512_cmp_ps_mask(mx, neg_inf, _CMP_EQ_OQ), _mm512_setzero_ps());
      const __m512 corr = exp_nonpositive(_mm512_sub_ps(m_old, base));
      __m512 sum = _mm512_mul_ps(_mm512_loadu_ps(&w.row_sum[16 * c]), corr);
      for (int j = 0; j < n_pairs; ++j) {
        __m512i two[2];
        for (int e = 0; e < 2; ++e) {
          const int k = 2 * j + e;
          __m512 p = _mm512_setzero_ps();
          if (k < n_keys) {
            const __m512 sk = _mm512_loadu_ps(s + k * lanes + 16 * c);
            p = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(sk, neg_inf, _CMP_NEQ_OQ), exp_nonpositive(_mm512_sub_ps(sk, base)));
          }
          sum = _mm512_add_ps(sum, p);
          two[e] = _mm512_cvtepu16_epi32(to_bf16(p));
        }
        _mm512_storeu_si512(pp + j * lanes + 16 * c, _mm512_or_si512(two[0], _mm512_slli_epi32(two[1], 16)));
      }
      _mm512_storeu_ps(&w.row_max[16 * c], mx);
      _mm512_storeu_ps(&w.row_sum[16 * c], sum);
      _mm512_storeu_ps(&w.corr[16 * c], corr);
    }
    // values into key pairs (dims in unpacklo/unpackhi order, see store_pair_row)
    __m512i* vp = reinterpret_cast<__m512i*>(w.v_pairs.data());
    for (int j = 0; j < n_pairs; ++j) {
      const uint16_t* r0 = values[2 * j] + h * d_n;
      const uint16_t* r1 = 2 * j + 1 < n_keys ? values[2 * j + 1] + h * d_n : nullptr;
      for (int64_t c = 0; c < ch / 2; ++c) {
        const __m512i x = _mm512_loadu_si512(r0 + 32 * c);
        const __m512i y = r1 ? _mm512_loadu_si512(r1 + 32 * c) : _mm512_setzero_si512();
        _mm512_storeu_si512(vp + j * ch + 2 * c, _mm512_unpacklo_epi16(x, y));
        _mm512_storeu_si512(vp + j * ch + 2 * c + 1, _mm512_unpackhi_epi16(x, y));
      }
    }
    // acc[r] = acc[r] * corr[r] + sum over pairs of p pair x value pair
    for (int64_t k0 = 0; k0 < ch; k0 += 8) switch (std::min<int64_t>(8, ch - k0)) {
        case 2: pv_chunk<2>(w, rows, n_pairs, lanes, ch, k0, d_n); break;
        case 4: pv_chunk<4>(w, rows, n_pairs, lanes, ch, k0, d_n); break;
        case 6: pv_chunk<6>(w, rows, n_pairs, lanes, ch, k0, d_n); break;
        default: pv_chunk<8>(w, rows, n_pairs, lanes, ch, k0, d_n); break;
      }
  }
  for (int64_t r = 0; r < rows; ++r)
    store_pair_row(&w.acc[r * d_n], ch, 1.f / w.row_sum[r],
                       out + (i0 + r / g_n) * out_stride + (h * g_n + r % g_n) * d_n);
}

void prefill_attention(const PrefillArgs& a, const uint16_t* qp, const uint16_t* kp, const uint16_t* vp,
                       const int64_t* table, int64_t num_kv_heads, int64_t lq, uint16_t* out, int64_t out_stride) {
  const int64_t group = a.group, head_dim = a.head_dim;
  const int64_t q_blocks = (lq + 15) / 16;
  // Later query blocks see more keys (causal): order them first, last, second, second to
  // last, ... so that each thread's contiguous share of items carries about the same work.
  parallel_for(0, q_blocks * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    PrefillScratch scratch;
    scratch.size_for(16 * group, head_dim);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t k = item / num_kv_heads, h = item % num_kv_heads;
      const int64_t qb = k % 2 == 0 ? k / 2 : q_blocks - 1 - k / 2;
      const int64_t i0 = qb * 16;
      prefill_block_bf16(a, qp, kp, vp, table, h, i0, std::min<int64_t>(16, lq - i0), scratch, out, out_stride);
    }
  });
}

}  // namespace kvserve::avx512
