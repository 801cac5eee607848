// What the sampler returns with logprobs, from each row of logits in two reads (the second from
// cache) instead of the five of float copy, logsumexp, gather and topk (kernels.h).
#include "neon.h"

namespace kvserve::neon {


// 4 values from p as fp32 (bf16 widened exactly), the first n of them when n < 4 (`fill` after).
inline float32x4_t load4(const float* p, int64_t n, float fill) {
  return n >= 4 ? vld1q_f32(p) : load_f32_partial(p, n, fill);
}
inline float32x4_t load4(const uint16_t* p, int64_t n, float fill) {
  if (n >= 4) return load_bf16(p);
  return vbslq_f32(first_lanes(n), load_bf16_partial(p, n), vdupq_n_f32(fill));
}

// Inserts x[i] into the top list (descending, ties to the lower index) when it belongs there.
template <typename T>
inline void offer(const T* x, int64_t i, int64_t k, int64_t& filled, float& threshold, float* top_vals,
                  int64_t* top_ids) {
  const float value = value_at(x, i);
  if (filled == k && !(value > threshold)) return;
  int64_t pos = filled < k ? filled++ : k - 1;  // drop the smallest when full
  while (pos > 0 && top_vals[pos - 1] < value) {  // strictly: equal values keep index order
    top_vals[pos] = top_vals[pos - 1], top_ids[pos] = top_ids[pos - 1];
    --pos;
  }
  top_vals[pos] = value, top_ids[pos] = i;
  if (filled == k) threshold = top_vals[k - 1];
}

// One row: log_norm = max + log(sum exp(x - max)); the k largest values (descending, ties to the
// lower index) and their ids. Past the row's end lanes read as -inf.
template <typename T>
void logprobs_row(const T* x, int64_t v, int64_t k, float* log_norm, float* top_vals, int64_t* top_ids) {
  int64_t filled = 0;           // top_vals[0:filled] descending
  float threshold = -INFINITY;  // the k-th largest so far once filled == k
  float32x4_t mx = vdupq_n_f32(-INFINITY);
  for (int64_t i = 0; i < v; i += 4) {
    const float32x4_t xs = load4(x + i, v - i, -INFINITY);
    mx = vmaxq_f32(mx, xs);
    if (k == 0) continue;
    // until k are held every element is a candidate; then only those above the k-th
    if (filled < k || vmaxvq_u32(vcgtq_f32(xs, vdupq_n_f32(threshold))) != 0)
      for (int64_t j = i; j < std::min(v, i + 4); ++j) offer(x, j, k, filled, threshold, top_vals, top_ids);
  }
  const float row_max = vmaxvq_f32(mx);
  if (row_max == -INFINITY) {  // every logit masked
    *log_norm = -INFINITY;
    return;
  }
  const float32x4_t vmax = vdupq_n_f32(row_max);
  float32x4_t sum = vdupq_n_f32(0.f);
  for (int64_t i = 0; i < v; i += 4) {  // -inf past the end: exp gives 0 there
    const float32x4_t e = exp_nonpositive(vsubq_f32(load4(x + i, v - i, -INFINITY), vmax));
    sum = vaddq_f32(sum, vbslq_f32(first_lanes(v - i), e, vdupq_n_f32(0.f)));
  }
  *log_norm = row_max + std::log(vaddvq_f32(sum));
}

void logprobs_topk(const void* x, bool x_bf16, int64_t ld, int64_t rows, int64_t v, const int64_t* tokens, int64_t k,
                   float* sampled, float* top_vals, int64_t* top_ids) {
  logprobs_topk_rows(x, x_bf16, ld, rows, v, tokens, k, sampled, top_vals, top_ids,
                     [](const auto* row, int64_t n, int64_t kk, float* norm, float* vals, int64_t* ids) {
                       logprobs_row(row, n, kk, norm, vals, ids);
                     });
}

}  // namespace kvserve::neon
