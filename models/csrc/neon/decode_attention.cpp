// Paged decode attention: one query token per request over the paged KV cache (kernels.h).
#include "neon.h"

namespace kvserve::neon {

// ---- paged decode attention --------------------------------------------------------
// For request b and KV head h: the G = H / KvH query heads h*G .. h*G+G-1 attend over keys
// [start, seq_len) (start = seq_len - window with a sliding window, else 0), read through the
// block table. Two passes over the keys: scores (a scratch row per query head), then softmax
// and the weighted sum of values. As PyTorch's CPU SDPA: probabilities are rounded to bf16
// before P @ V, the denominator sums them unrounded.

// Per-thread scratch, grown as needed and kept between calls.
struct DecodeScratch {
  std::vector<float> q, scores, denom;
  std::vector<const uint16_t*> keys, values;  // each cached token's row (all KV heads)
};

// The scores of query row qf (D = 16 CH floats) against 4 keys (head offset applied): four
// dot products kept as 2 partial sums each over 8 dims, then one pairwise reduction.
template <int CH>
inline float32x4_t score4(const float* qf, const uint16_t* k0, const uint16_t* k1, const uint16_t* k2,
                          const uint16_t* k3) {
  const uint16_t* keys[4] = {k0, k1, k2, k3};
  float32x4_t lo[4], hi[4];
  for (int t = 0; t < 4; ++t) lo[t] = hi[t] = vdupq_n_f32(0.f);
  for (int c = 0; c < 2 * CH; ++c) {  // 8 dims a step
    const float32x4_t qa = vld1q_f32(qf + 8 * c), qb = vld1q_f32(qf + 8 * c + 4);
    for (int t = 0; t < 4; ++t) {
      const uint16x8_t kv = vld1q_u16(keys[t] + 8 * c);
      lo[t] = vfmaq_f32(lo[t], qa, widen_bf16(vget_low_u16(kv)));
      hi[t] = vfmaq_f32(hi[t], qb, vreinterpretq_f32_u32(vshll_high_n_u16(kv, 16)));
    }
  }
  float32x4_t sum[4];
  for (int t = 0; t < 4; ++t) sum[t] = vaddq_f32(lo[t], hi[t]);
  return vpaddq_f32(vpaddq_f32(sum[0], sum[1]), vpaddq_f32(sum[2], sum[3]));
}

// Softmax of one score row of length len in place: its probabilities rounded to bf16 (kept as
// fp32), the unrounded sum returned.
inline float softmax_row(float* row, int64_t len) {
  float32x4_t mx = vdupq_n_f32(-INFINITY);
  int64_t i = 0;
  for (; i + 4 <= len; i += 4) mx = vmaxq_f32(mx, vld1q_f32(row + i));
  if (i < len) mx = vmaxq_f32(mx, load_f32_partial(row + i, len - i, -INFINITY));
  const float32x4_t row_max = vdupq_n_f32(vmaxvq_f32(mx));
  float32x4_t sum = vdupq_n_f32(0.f);
  for (i = 0; i < len; i += 4) {  // the row's stride is a multiple of 4: the tail lanes are scratch
    const uint32x4_t valid = first_lanes(len - i);
    const float32x4_t e = vbslq_f32(valid, exp_nonpositive(vsubq_f32(vld1q_f32(row + i), row_max)), vdupq_n_f32(0.f));
    vst1q_f32(row + i, round_bf16(e));
    sum = vaddq_f32(sum, e);
  }
  return vaddvq_f32(sum);
}

// out[g] = bf16(sum over tokens of p[g][t] v[t] / denom[g]) for rows g0 .. g0 + GN - 1 (probs
// rows p_stride apart), 16 dims at a time: GN x 4 accumulators, each value row widened once.
template <int CH, int GN>
inline void weigh_values(const float* probs, int64_t p_stride, const float* denom,
                         const uint16_t* const* values, int64_t head_off, int64_t len, uint16_t* out,
                         int64_t out_stride) {
  for (int c = 0; c < CH; ++c) {
    float32x4_t acc[GN][4];
    for (int g = 0; g < GN; ++g)
      for (int v = 0; v < 4; ++v) acc[g][v] = vdupq_n_f32(0.f);
    for (int64_t t = 0; t < len; ++t) {
      const uint16_t* vr = values[t] + head_off + 16 * c;
      const uint16x8_t a = vld1q_u16(vr), b = vld1q_u16(vr + 8);
      const float32x4_t v[4] = {widen_bf16(vget_low_u16(a)), vreinterpretq_f32_u32(vshll_high_n_u16(a, 16)),
                                widen_bf16(vget_low_u16(b)), vreinterpretq_f32_u32(vshll_high_n_u16(b, 16))};
      for (int g = 0; g < GN; ++g) {
        const float p = probs[g * p_stride + t];
        for (int k = 0; k < 4; ++k) acc[g][k] = vfmaq_n_f32(acc[g][k], v[k], p);
      }
    }
    for (int g = 0; g < GN; ++g) {
      const float inv = 1.f / denom[g];
      for (int k = 0; k < 4; ++k) store_bf16(out + g * out_stride + 16 * c + 4 * k, vmulq_n_f32(acc[g][k], inv));
    }
  }
}

// KV heads [h0, h1) of one request over its keys [start, end); q and out point at the request.
template <int CH>
void attend(const DecodeArgs& a, const uint16_t* q, const uint16_t* kc, const uint16_t* vc, const int64_t* table,
            int64_t start, int64_t end, int64_t h0, int64_t h1, DecodeScratch& w, uint16_t* out) {
  constexpr int64_t D = 16 * CH;
  const int64_t len = end - start, g_n = a.group, rows = (h1 - h0) * g_n, stride = (len + 3) / 4 * 4;
  if ((int64_t)w.keys.size() < stride) w.keys.resize(stride), w.values.resize(stride);
  if ((int64_t)w.scores.size() < rows * stride) w.scores.resize(rows * stride);
  if ((int64_t)w.q.size() < rows * D) w.q.resize(rows * D);
  if ((int64_t)w.denom.size() < rows) w.denom.resize(rows);
  for (int64_t t = 0; t < len; t += 4096) {  // token_rows takes an int count
    const int n = (int)std::min<int64_t>(4096, len - t);
    token_rows(kc, table, a.block_size, a.cache_stride_block, a.cache_stride_token, start + t, n, &w.keys[t]);
    token_rows(vc, table, a.block_size, a.cache_stride_block, a.cache_stride_token, start + t, n, &w.values[t]);
  }
  for (int64_t t = len; t < stride; ++t) w.keys[t] = w.keys[0], w.values[t] = w.values[0];  // padding: read, unused
  for (int64_t r = 0; r < rows; ++r) {
    const uint16_t* qr = q + (h0 * g_n + r) * a.q_stride_head;
    for (int64_t d = 0; d < D; d += 4) vst1q_f32(&w.q[r * D + d], load_bf16(qr + d));
  }
  // Pass 1: scores, 4 keys at a time, the head's query rows in turn (the keys stay in L1).
  for (int64_t h = h0; h < h1; ++h) {
    const int64_t off = h * D;
    for (int64_t t = 0; t < len; t += 4) {
      const uint16_t* const* k = &w.keys[t];
      for (int64_t g = 0; g < g_n; ++g) {
        const int64_t r = (h - h0) * g_n + g;
        float32x4_t s = vmulq_n_f32(score4<CH>(&w.q[r * D], k[0] + off, k[1] + off, k[2] + off, k[3] + off), a.scale);
        if (a.bias) {
          const float* b = a.bias + (h * g_n + g) * a.bias_stride + (a.bias_len - end + start + t);
          s = vaddq_f32(s, len - t >= 4 ? vld1q_f32(b) : load_f32_partial(b, len - t, 0.f));
        }
        vst1q_f32(&w.scores[r * stride + t], s);
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    if (a.softcap > 0.f) softcap_scores(&w.scores[r * stride], len, 1.f, a.softcap);  // scaled already
    w.denom[r] = softmax_row(&w.scores[r * stride], len);
  }
  // Pass 2: the values, up to 4 query rows of a head at a time.
  for (int64_t h = h0; h < h1; ++h)
    for (int64_t g = 0; g < g_n; g += 4) {
      const int64_t r = (h - h0) * g_n + g;
      const float* p = &w.scores[r * stride];
      uint16_t* o = out + (h0 * g_n + r) * D;
      switch (std::min<int64_t>(4, g_n - g)) {
        case 1: weigh_values<CH, 1>(p, stride, &w.denom[r], w.values.data(), h * D, len, o, D); break;
        case 2: weigh_values<CH, 2>(p, stride, &w.denom[r], w.values.data(), h * D, len, o, D); break;
        case 3: weigh_values<CH, 3>(p, stride, &w.denom[r], w.values.data(), h * D, len, o, D); break;
        default: weigh_values<CH, 4>(p, stride, &w.denom[r], w.values.data(), h * D, len, o, D); break;
      }
    }
}

template <int CH>
struct Attend {
  static constexpr auto run = attend<CH>;
};
using AttendFn = decltype(&attend<2>);

void decode_attention(const DecodeArgs& a, const uint16_t* q, const uint16_t* kc, const uint16_t* vc,
                      const int64_t* table, const int64_t* seq_lens, int64_t num_reqs, uint16_t* out) {
  // Enough requests to share out: one work item per request (all its KV heads); otherwise one
  // per (request, KV head).
  const int64_t heads_per_item = a.num_kv_heads > 1 && num_reqs < 2 * num_threads() ? 1 : a.num_kv_heads;
  const int64_t items_per_req = a.num_kv_heads / heads_per_item;
  const AttendFn fn = for_head_dim<AttendFn, Attend>(a.head_dim);
  parallel_for(0, num_reqs * items_per_req, 1, [&](int64_t begin, int64_t end) {
    thread_local DecodeScratch scratch;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / items_per_req, h0 = item % items_per_req * heads_per_item, seq_len = seq_lens[b];
      const int64_t start = a.window > 0 ? std::max<int64_t>(0, seq_len - a.window) : 0;
      fn(a, q + b * a.q_stride_req, kc, vc, table + b * a.table_stride, start, seq_len, h0, h0 + heads_per_item,
         scratch, out + b * a.num_kv_heads * a.group * a.head_dim);
    }
  });
}

}  // namespace kvserve::neon
