// What the sampler returns with logprobs, from each row of logits in two reads (the second from
// cache) instead of the five of float copy, logsumexp, gather and topk (kernels.h). The AVX-512
// set's algorithm on 16 values per step, held as two 8-lane vectors.
#include "avx2.h"

namespace kvserve::avx2 {
namespace {

using bf16_t = uint16_t;


// 8 row values as fp32 (bf16 widened exactly); partial: the first n (< 8), -inf after, so
// padding never wins the max and adds exp(-inf) = 0 to the sum.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const bf16_t* p) { return load_bf16(p); }
inline __m256 load8_partial(const float* p, int64_t n) {
  alignas(32) float tmp[8];
  std::fill_n(tmp, 8, -INFINITY);
  std::memcpy(tmp, p, n * sizeof(float));
  return _mm256_load_ps(tmp);
}
inline __m256 load8_partial(const bf16_t* p, int64_t n) {
  alignas(16) bf16_t tmp[8];
  std::fill_n(tmp, 8, bf16_t{0xFF80});  // -inf
  std::memcpy(tmp, p, n * sizeof(bf16_t));
  return load_bf16(tmp);
}

// Values i .. i + 15 of a row of v into lo, hi (-inf past the end); -> the mask of lanes in the row.
template <typename T>
inline unsigned load16(const T* x, int64_t i, int64_t v, __m256& lo, __m256& hi) {
  const int64_t left = v - i;
  if (left >= 16) {
    lo = load8(x + i), hi = load8(x + i + 8);
    return 0xFFFF;
  }
  lo = left >= 8 ? load8(x + i) : load8_partial(x + i, left);
  hi = left > 8 ? load8_partial(x + i + 8, left - 8) : _mm256_set1_ps(-INFINITY);
  return (1u << left) - 1;
}

// One row: log_norm = max + log(sum exp(x - max)); the k largest values (descending, ties to the
// lower index) and their ids. Only lanes above the current k-th largest are inspected one by one.
template <typename T>
void logprobs_row(const T* x, int64_t v, int64_t k, float* log_norm, float* top_vals, int64_t* top_ids) {
  int64_t filled = 0;           // top_vals[0:filled] descending
  float threshold = -INFINITY;  // the k-th largest so far once filled == k
  __m256 mx0 = _mm256_set1_ps(-INFINITY), mx1 = mx0;
  for (int64_t i = 0; i < v; i += 16) {
    __m256 lo, hi;
    const unsigned m = load16(x, i, v, lo, hi);
    mx0 = _mm256_max_ps(mx0, lo);
    mx1 = _mm256_max_ps(mx1, hi);
    if (k == 0) continue;
    const __m256 t = _mm256_set1_ps(threshold);
    unsigned above = (_mm256_movemask_ps(_mm256_cmp_ps(lo, t, _CMP_GT_OQ)) |
                      _mm256_movemask_ps(_mm256_cmp_ps(hi, t, _CMP_GT_OQ)) << 8) & m;
    if (filled < k) above = m;  // (until k are held, every lane is a candidate)
    while (above) {
      const int lane = __builtin_ctz(above);
      above &= above - 1;
      const float value = value_at(x, i + lane);
      if (filled == k && !(value > threshold)) continue;
      int64_t pos = filled < k ? filled++ : k - 1;    // drop the smallest when full
      while (pos > 0 && top_vals[pos - 1] < value) {  // strictly: equal values keep index order
        top_vals[pos] = top_vals[pos - 1], top_ids[pos] = top_ids[pos - 1];
        --pos;
      }
      top_vals[pos] = value, top_ids[pos] = i + lane;
      if (filled == k) threshold = top_vals[k - 1];
    }
  }
  const float row_max = hmax(_mm256_max_ps(mx0, mx1));
  if (row_max == -INFINITY) {  // every logit masked
    *log_norm = -INFINITY;
    return;
  }
  const __m256 vmax = _mm256_set1_ps(row_max);
  __m256 sum0 = _mm256_setzero_ps(), sum1 = _mm256_setzero_ps();
  for (int64_t i = 0; i < v; i += 16) {
    __m256 lo, hi;
    load16(x, i, v, lo, hi);
    sum0 = _mm256_add_ps(sum0, exp_nonpositive(_mm256_sub_ps(lo, vmax)));
    sum1 = _mm256_add_ps(sum1, exp_nonpositive(_mm256_sub_ps(hi, vmax)));
  }
  *log_norm = row_max + std::log(hsum(_mm256_add_ps(sum0, sum1)));
}

}  // namespace

void logprobs_topk(const void* x, bool x_bf16, int64_t ld, int64_t rows, int64_t v, const int64_t* tokens, int64_t k,
                   float* sampled, float* top_vals, int64_t* top_ids) {
  logprobs_topk_rows(x, x_bf16, ld, rows, v, tokens, k, sampled, top_vals, top_ids,
                     [](const auto* row, int64_t n, int64_t kk, float* norm, float* vals, int64_t* ids) {
                       logprobs_row(row, n, kk, norm, vals, ids);
                     });
}

}  // namespace kvserve::avx2
