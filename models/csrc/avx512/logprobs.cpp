// What the sampler returns with logprobs, from each row of logits in two reads (the second from
// cache) instead of the five of float copy, logsumexp, gather and topk (kernels.h).
#include "avx512.h"

namespace kvserve::avx512 {

using bf16_t = uint16_t;


// Row values as fp32 (bf16 widened exactly).
template <typename T>
KV_AVX512_BF16 inline __m512 load16(const T* p, __mmask16 m);
template <>
KV_AVX512_BF16 inline __m512 load16<float>(const float* p, __mmask16 m) {
  return _mm512_maskz_loadu_ps(m, p);
}
template <>
KV_AVX512_BF16 inline __m512 load16<bf16_t>(const bf16_t* p, __mmask16 m) {
  const __m256i raw = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// One row: log_norm = max + log(sum exp(x - max)); the k largest values (descending, ties to the
// lower index) and their ids. Masked-out lanes read as -inf.
template <typename T>
KV_AVX512_BF16 void logprobs_row(const T* x, int64_t v, int64_t k, float* log_norm, float* top_vals,
                                 int64_t* top_ids) {
  int64_t filled = 0;  // top_vals[0:filled] descending
  float threshold = -INFINITY;  // the k-th largest so far once filled == k
  __m512 mx = _mm512_set1_ps(-INFINITY);
  for (int64_t i = 0; i < v; i += 16) {
    const __mmask16 m = v - i >= 16 ? 0xFFFF : (__mmask16)((1u << (v - i)) - 1);
    const __m512 xs = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), m, load16<T>(x + i, m));
    mx = _mm512_max_ps(mx, xs);
    if (k == 0) continue;
    __mmask16 above = _mm512_cmp_ps_mask(xs, _mm512_set1_ps(threshold), _CMP_GT_OQ) & m;
    if (filled < k) above = m;  // (until k are held, every lane is a candidate)
    while (above) {
      const int lane = __builtin_ctz(above);
      above &= above - 1;
      const float value = value_at(x, i + lane);
      if (filled == k && !(value > threshold)) continue;
      int64_t pos = filled < k ? filled++ : k - 1;  // drop the smallest when full
      while (pos > 0 && top_vals[pos - 1] < value) {  // strictly: equal values keep index order
        top_vals[pos] = top_vals[pos - 1], top_ids[pos] = top_ids[pos - 1];
        --pos;
      }
      top_vals[pos] = value, top_ids[pos] = i + lane;
      if (filled == k) threshold = top_vals[k - 1];
    }
  }
  const float row_max = _mm512_reduce_max_ps(mx);
  if (row_max == -INFINITY) {  // every logit masked
    *log_norm = -INFINITY;
    return;
  }
  const __m512 vmax = _mm512_set1_ps(row_max);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t i = 0; i < v; i += 16) {
    const __mmask16 m = v - i >= 16 ? 0xFFFF : (__mmask16)((1u << (v - i)) - 1);
    const __m512 e = exp_nonpositive(_mm512_sub_ps(load16<T>(x + i, m), vmax));
    sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(m, e));
  }
  *log_norm = row_max + std::log(_mm512_reduce_add_ps(sum));
}

void logprobs_topk(const void* x, bool x_bf16, int64_t ld, int64_t rows, int64_t v, const int64_t* tokens, int64_t k,
                   float* sampled, float* top_vals, int64_t* top_ids) {
  logprobs_topk_rows(x, x_bf16, ld, rows, v, tokens, k, sampled, top_vals, top_ids,
                     [](const auto* row, int64_t n, int64_t kk, float* norm, float* vals, int64_t* ids) {
                       logprobs_row(row, n, kk, norm, vals, ids);
                     });
}

}  // namespace kvserve::avx512
