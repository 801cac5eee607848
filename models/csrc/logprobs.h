// kvserve::logprobs_topk: what the sampler returns with logprobs, from each row of logits in two
// reads (the second from cache) instead of the five of float copy, logsumexp, gather and topk.
#pragma once

#include "common.h"

namespace kvserve {

// Row values as fp32 (bf16 widened exactly).
template <typename T>
KV_AVX512_BF16 inline __m512 load16(const T* p, __mmask16 m);
template <>
KV_AVX512_BF16 inline __m512 load16<float>(const float* p, __mmask16 m) {
  return _mm512_maskz_loadu_ps(m, p);
}
template <>
KV_AVX512_BF16 inline __m512 load16<c10::BFloat16>(const c10::BFloat16* p, __mmask16 m) {
  const __m256i raw = _mm256_maskz_loadu_epi16(m, reinterpret_cast<const uint16_t*>(p));
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
      const float value = static_cast<float>(x[i + lane]);
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

// logits [B, V] (bf16 or fp32, contiguous rows), token_ids [B] int64, k >= 0 ->
// (sampled logprobs [B], top-k logprobs [B, k], their ids [B, k] int64), all fp32 log-softmax.
std::tuple<at::Tensor, at::Tensor, at::Tensor> logprobs_topk(const at::Tensor& logits, const at::Tensor& token_ids,
                                                             int64_t k) {
  TORCH_CHECK(has_avx512_bf16(), "logprobs_topk needs AVX512-BF16");
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1 &&
                  (logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kBFloat16),
              "logits must be [B, V] float32 or bf16 rows");
  const int64_t b = logits.size(0), v = logits.size(1);
  TORCH_CHECK(token_ids.dim() == 1 && token_ids.size(0) == b && token_ids.scalar_type() == at::kLong,
              "token_ids must be int64 [B]");
  TORCH_CHECK(k >= 0 && k <= v, "k must be in [0, V]");
  const auto f32 = logits.options().dtype(at::kFloat);
  at::Tensor sampled = at::empty({b}, f32), top_vals = at::empty({b, k}, f32);
  at::Tensor top_ids = at::empty({b, k}, logits.options().dtype(at::kLong));
  const int64_t* tok = token_ids.data_ptr<int64_t>();
  float* sp = sampled.data_ptr<float>();
  float* tv = top_vals.data_ptr<float>();
  int64_t* ti = top_ids.data_ptr<int64_t>();
  AT_DISPATCH_SWITCH(logits.scalar_type(), "logprobs_topk",
    AT_DISPATCH_CASE(at::kFloat, [&] {
      const float* x = logits.data_ptr<float>();
      at::parallel_for(0, b, 1, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) {
          const float* row = x + r * logits.stride(0);
          float norm;
          logprobs_row<float>(row, v, k, &norm, tv + r * k, ti + r * k);
          sp[r] = row[tok[r]] - norm;
          for (int64_t j = 0; j < k; ++j) tv[r * k + j] -= norm;
        }
      });
    })
    AT_DISPATCH_CASE(at::kBFloat16, [&] {
      const c10::BFloat16* x = logits.data_ptr<c10::BFloat16>();
      at::parallel_for(0, b, 1, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) {
          const c10::BFloat16* row = x + r * logits.stride(0);
          float norm;
          logprobs_row<c10::BFloat16>(row, v, k, &norm, tv + r * k, ti + r * k);
          sp[r] = static_cast<float>(row[tok[r]]) - norm;
          for (int64_t j = 0; j < k; ++j) tv[r * k + j] -= norm;
        }
      });
    })
  );
  return {sampled, top_vals, top_ids};
}

}  // namespace kvserve
