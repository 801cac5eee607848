// Paged decode attention: one query token per request over the paged KV cache (kernels.h).
#include "avx512.h"

namespace kvserve::avx512 {

// ---- paged decode attention --------------------------------------------------------
// For request b and KV head h: the G = H / KvH query heads h*G .. h*G+G-1 attend over
// keys [start, seq_len) (start = seq_len - window with a sliding window, else 0), read
// through the block table. Two passes over the keys: scores (kept in a scratch row per
// query head), then softmax and the weighted sum of values.

// v[i] summed across its 16 lanes, for i = 0..15, as one vector (lane i = sum of v[i]):
// a transpose-and-add tree, 45 shuffles/adds instead of 16 horizontal reductions.
KV_AVX512_BF16 inline __m512 sum_each16(const __m512* v) {
  __m512 pairs[8], quads[4];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
    pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: that lane's sums of 4 vectors
    const __m512d x = _mm512_castps_pd(pairs[2 * i]), y = _mm512_castps_pd(pairs[2 * i + 1]);
    quads[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  const __m512 w01 = _mm512_add_ps(_mm512_shuffle_f32x4(quads[0], quads[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_f32x4(quads[0], quads[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 w23 = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2], quads[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_f32x4(quads[2], quads[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(w01, w23, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(w01, w23, _MM_SHUFFLE(3, 1, 3, 1)));
}

// q . k for up to 16 consecutive cached tokens (rows past n_tok are not read), one lane per
// token: 16 partial dot products over the head's ch / 2 32-dim blocks, then one transposed
// reduction instead of 16 horizontal ones. N = 16 compiles the common full group with a
// fixed token count (no branches, no spills); N = 0 takes n_tok at run time.
template <int N>
KV_AVX512_BF16 inline __m512 score_keys(const uint16_t* q, const uint16_t* const* keys, int64_t head_off, int n_tok,
                                        int64_t ch) {
  const int n = N ? N : n_tok;
  __m512 part[16];
  for (int i = 0; i < 16; ++i) part[i] = _mm512_setzero_ps();
  for (int64_t c = 0; c < ch / 2; ++c) {
    const Pairs qv = load_pairs(q + 32 * c);
    for (int i = 0; i < n; ++i)
      part[i] = dot_pairs(part[i], qv, load_pairs(keys[i] + head_off + 32 * c));
  }
  return sum_each16(part);
}

// acc[g] += sum over the group's tokens of p[g][t] * v[t], for the g_n query rows sharing
// one KV head, in one chunk of CW x 16 dims (rows acc_stride apart). Probabilities come as
// bf16 token pairs (p_pairs[g * p_stride + j] holds tokens 2j, 2j+1), values are
// interleaved into the same pairs, so one vdpbf16ps does two tokens x 16 dims. Accumulators
// keep the dims in unpacklo/unpackhi order (see store_pair_row); up to GB rows stay in
// registers for the whole group.
template <int CW, int N>
KV_AVX512_BF16 inline void accumulate_chunk(float* acc, int64_t acc_stride, int64_t g_n, const uint32_t* p_pairs,
                                            int64_t p_stride, const uint16_t* const* values, int64_t head_off,
                                            int n_tok) {
  const int n = N ? N : n_tok;
  constexpr int GB = (28 - CW) / CW;
  for (int64_t g0 = 0; g0 < g_n; g0 += GB) {
    const int gn = (int)std::min<int64_t>(GB, g_n - g0);
    __m512 sum[GB][CW];
    for (int g = 0; g < GB; ++g)
      if (g < gn)
        for (int k = 0; k < CW; ++k) sum[g][k] = _mm512_loadu_ps(acc + (g0 + g) * acc_stride + 16 * k);
    for (int j = 0; 2 * j < n; ++j) {
      const uint16_t* r0 = values[2 * j] + head_off;
      const uint16_t* r1 = (N || 2 * j + 1 < n) ? values[2 * j + 1] + head_off : nullptr;
      __m512i pairs[CW];
      for (int c = 0; c < CW / 2; ++c) {
        const __m512i x = _mm512_loadu_si512(r0 + 32 * c);
        const __m512i y = r1 ? _mm512_loadu_si512(r1 + 32 * c) : _mm512_setzero_si512();
        pairs[2 * c] = _mm512_unpacklo_epi16(x, y);
        pairs[2 * c + 1] = _mm512_unpackhi_epi16(x, y);
      }
      for (int g = 0; g < GB; ++g)
        if (g < gn) {
          const Pairs p = as_pairs(_mm512_set1_epi32((int)p_pairs[(g0 + g) * p_stride + j]));
          for (int k = 0; k < CW; ++k) sum[g][k] = dot_pairs(sum[g][k], as_pairs(pairs[k]), p);
        }
    }
    for (int g = 0; g < GB; ++g)
      if (g < gn)
        for (int k = 0; k < CW; ++k) _mm512_storeu_ps(acc + (g0 + g) * acc_stride + 16 * k, sum[g][k]);
  }
}

// accumulate_chunk over the head's ch x 16 dims, 128 at a time: the chunk width alone is a
// template parameter, so each output dim sees the same operations as one unbroken row while
// only four widths are compiled (not one kernel per head size).
template <int N>
KV_AVX512_BF16 inline void accumulate_pairs(float* acc, int64_t ch, int64_t g_n, const uint32_t* p_pairs,
                                            int64_t p_stride, const uint16_t* const* values, int64_t head_off,
                                            int n_tok) {
  for (int64_t k0 = 0; k0 < ch; k0 += 8) {
    float* a = acc + 16 * k0;
    const int64_t off = head_off + 16 * k0;
    switch (std::min<int64_t>(8, ch - k0)) {
      case 2: accumulate_chunk<2, N>(a, ch * 16, g_n, p_pairs, p_stride, values, off, n_tok); break;
      case 4: accumulate_chunk<4, N>(a, ch * 16, g_n, p_pairs, p_stride, values, off, n_tok); break;
      case 6: accumulate_chunk<6, N>(a, ch * 16, g_n, p_pairs, p_stride, values, off, n_tok); break;
      default: accumulate_chunk<8, N>(a, ch * 16, g_n, p_pairs, p_stride, values, off, n_tok); break;
    }
  }
}

// bf16, head_dim a multiple of 32 (<= 256): KV heads [h0, h1) of one request. Pass 1 scores every key (fp32, row r of `scores` at r * row_stride); the softmax
// then overwrites each row in place with its probabilities rounded to bf16 (as PyTorch's
// CPU SDPA does before its P @ V product; the denominator sums them unrounded, as there);
// pass 2 accumulates the values. acc: [(h1 - h0) * G][D]; q/out point at the request.
KV_AVX512_BF16 void attend_bf16(const DecodeArgs& a, const uint16_t* q, const uint16_t* kc, const uint16_t* vc,
                                const int64_t* table, int64_t start, int64_t end, int64_t h0, int64_t h1,
                                const DecodeItem* next, bool keys_prefetched, float* scores, float* acc,
                                uint16_t* out) {
  const int64_t len = end - start, g_n = a.group, d_n = a.head_dim, ch = d_n / 16;
  const int64_t rows = (h1 - h0) * g_n, row_stride = decode_row_stride(len);
  const __m512 scale = _mm512_set1_ps(a.scale);
  const uint16_t* tokens[16];
  const uint16_t* ahead[16];
  RowPrefetcher values_pf, keys_pf;
  auto prefetch = [&](RowPrefetcher& pf, const uint16_t* cache, const int64_t* tbl, int64_t t0, int64_t stop,
                      int64_t g_h0, int64_t g_h1) {
    const int n = (int)std::min<int64_t>(16, stop - t0);
    if (n <= 0) return void(pf.n_rows = 0);
    token_rows(cache, tbl, a.block_size, a.cache_stride_block, a.cache_stride_token, t0, n, ahead);
    pf.start(ahead, n, g_h0 * d_n, (g_h1 - g_h0) * d_n * 2);
  };
  // Pass 1, groups of 16 tokens from `start` (so bf16 pairs line up). Meanwhile: this
  // group's values (pass 2 reads them) and, unless the previous item fetched them, the
  // next group's keys.
  for (int64_t t0 = start; t0 < end; t0 += 16) {
    const int n_tok = (int)std::min<int64_t>(16, end - t0);
    const __mmask16 m = n_tok == 16 ? 0xFFFF : (__mmask16)((1u << n_tok) - 1);
    token_rows(kc, table, a.block_size, a.cache_stride_block, a.cache_stride_token, t0, n_tok, tokens);
    prefetch(values_pf, vc, table, t0, end, h0, h1);
    if (!keys_prefetched) prefetch(keys_pf, kc, table, t0 + 16, end, h0, h1);
    const int calls = (int)rows, per_call = (values_pf.lines_left() + keys_pf.lines_left() + calls - 1) / calls;
    for (int64_t h = h0; h < h1; ++h)
      for (int64_t g = 0; g < g_n; ++g) {
        values_pf.issue(per_call);
        keys_pf.issue(per_call);
        const uint16_t* qg = q + (h * g_n + g) * a.q_stride_head;
        const __m512 s = n_tok == 16 ? score_keys<16>(qg, tokens, h * d_n, 16, ch)
                                     : score_keys<0>(qg, tokens, h * d_n, n_tok, ch);
        __m512 scaled = _mm512_mul_ps(s, scale);
        if (a.bias)
          scaled = _mm512_add_ps(scaled, _mm512_maskz_loadu_ps(m, a.bias + (h * g_n + g) * a.bias_stride +
                                                                      (a.bias_len - end + t0)));
        _mm512_mask_storeu_ps(scores + ((h - h0) * g_n + g) * row_stride + (t0 - start), m, scaled);
      }
  }
  std::vector<float> denom(rows);
  for (int64_t r = 0; r < rows; ++r) {
    float* row = scores + r * row_stride;
    if (a.softcap > 0.f) softcap_scores(row, len, 1.f, a.softcap);  // the scores are scaled already
    __m512 mx = _mm512_set1_ps(-INFINITY);
    for (int64_t i = 0; i < len; i += 16) {
      const __mmask16 m = len - i >= 16 ? 0xFFFF : (__mmask16)((1u << (len - i)) - 1);
      mx = _mm512_mask_max_ps(mx, m, mx, _mm512_maskz_loadu_ps(m, row + i));
    }
    const __m512 row_max = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
    __m512 sum = _mm512_setzero_ps();
    uint16_t* probs = reinterpret_cast<uint16_t*>(row);  // written behind the reads
    for (int64_t i = 0; i < len; i += 16) {  // zeros past len: the odd last token's partner
      const __mmask16 m = len - i >= 16 ? 0xFFFF : (__mmask16)((1u << (len - i)) - 1);
      const __m512 e = _mm512_maskz_mov_ps(m, exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, row + i), row_max)));
      _mm256_storeu_si256((__m256i*)(probs + i), to_bf16(e));
      sum = _mm512_add_ps(sum, e);
    }
    denom[r] = _mm512_reduce_add_ps(sum);
  }
  std::fill(acc, acc + rows * d_n, 0.f);
  const uint32_t* pairs = reinterpret_cast<const uint32_t*>(scores);  // row r's pairs at r * row_stride
  // Pass 2; meanwhile the next item's keys at the same offset.
  for (int64_t t0 = start; t0 < end; t0 += 16) {
    const int n_tok = (int)std::min<int64_t>(16, end - t0);
    token_rows(vc, table, a.block_size, a.cache_stride_block, a.cache_stride_token, t0, n_tok, tokens);
    keys_pf.n_rows = 0;
    if (next) prefetch(keys_pf, kc, next->table, next->start + (t0 - start), next->end, next->h0, next->h1);
    const int per_call = (keys_pf.lines_left() + (int)(h1 - h0) - 1) / (int)(h1 - h0);
    for (int64_t h = h0; h < h1; ++h) {
      keys_pf.issue(per_call);
      const uint32_t* ph = pairs + (h - h0) * g_n * row_stride + (t0 - start) / 2;
      float* ah = acc + (h - h0) * g_n * d_n;
      if (n_tok == 16) accumulate_pairs<16>(ah, ch, g_n, ph, row_stride, tokens, h * d_n, 16);
      else accumulate_pairs<0>(ah, ch, g_n, ph, row_stride, tokens, h * d_n, n_tok);
    }
  }
  for (int64_t r = 0; r < rows; ++r) store_pair_row(acc + r * d_n, ch, 1.f / denom[r], out + (h0 * g_n + r) * d_n);
}

void decode_attention(const DecodeArgs& a, const uint16_t* q, const uint16_t* kc, const uint16_t* vc, const int64_t* table,
                      const int64_t* seq_lens, int64_t num_reqs, uint16_t* out) {
  // Enough requests to share out: one work item per request (all its KV heads, reading
  // each cached token's heads together); otherwise one per (request, KV head).
  const int64_t heads_per_item = a.num_kv_heads > 1 && num_reqs < 2 * num_threads() ? 1 : a.num_kv_heads;
  const int64_t items_per_req = a.num_kv_heads / heads_per_item;
  auto item_at = [&](int64_t item) {
    const int64_t b = item / items_per_req, h0 = item % items_per_req * heads_per_item, seq_len = seq_lens[b];
    const int64_t start = a.window > 0 ? std::max<int64_t>(0, seq_len - a.window) : 0;
    return DecodeItem{table + b * a.table_stride, start, seq_len, h0, h0 + heads_per_item};
  };
  parallel_for(0, num_reqs * items_per_req, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, acc(heads_per_item * a.group * a.head_dim);
    for (int64_t item = begin; item < end; ++item) {
      const DecodeItem it = item_at(item);
      const int64_t b = item / items_per_req;
      scores.resize(std::max<int64_t>(1, heads_per_item * a.group * decode_row_stride(it.end - it.start)));
      // the item after this one in this thread's range: its keys are fetched during our pass 2
      const DecodeItem next = item + 1 < end ? item_at(item + 1) : DecodeItem{};
      attend_bf16(a, q + b * a.q_stride_req, kc, vc, it.table, it.start, it.end, it.h0, it.h1,
             item + 1 < end ? &next : nullptr, item > begin, scores.data(), acc.data(),
             out + b * a.num_kv_heads * a.group * a.head_dim);
    }
  });
}

}  // namespace kvserve::avx512
