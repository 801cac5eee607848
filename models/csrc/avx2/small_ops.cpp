// The fused per-layer ops on bf16 rows and the greedy argmax (kernels.h), on 8-lane fp32
// vectors. Each keeps the model-dtype rounding steps of the PyTorch code it replaces
// (models/layers.py) and the arithmetic of the AVX-512 set's versions (avx512/small_ops.cpp).
#include "avx2.h"

namespace kvserve::avx2 {
namespace {

// 8 bf16 as fp32 with the lanes past n (< 8) at -inf, so they never win a max.
inline __m256 load_bf16_partial_neg_inf(const uint16_t* p, int64_t n) {
  alignas(16) uint16_t tmp[8] = {0xFF80, 0xFF80, 0xFF80, 0xFF80, 0xFF80, 0xFF80, 0xFF80, 0xFF80};
  std::memcpy(tmp, p, n * sizeof(uint16_t));
  return load_bf16(tmp);
}

// The first index of the row's maximum, in two passes over a row that stays in cache: the
// maximum (four independent max chains), then the first lane equal to it. Same result as
// torch.argmax on rows without NaN (-0 and +0 compare equal there too).
int64_t argmax_row_bf16(const uint16_t* row, int64_t n) {
  __m256 m0 = _mm256_set1_ps(-INFINITY), m1 = m0, m2 = m0, m3 = m0;
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    m0 = _mm256_max_ps(m0, load_bf16(row + i));
    m1 = _mm256_max_ps(m1, load_bf16(row + i + 8));
    m2 = _mm256_max_ps(m2, load_bf16(row + i + 16));
    m3 = _mm256_max_ps(m3, load_bf16(row + i + 24));
  }
  for (; i + 8 <= n; i += 8) m0 = _mm256_max_ps(m0, load_bf16(row + i));
  if (i < n) m1 = _mm256_max_ps(m1, load_bf16_partial_neg_inf(row + i, n - i));
  const __m256 top = _mm256_set1_ps(hmax(_mm256_max_ps(_mm256_max_ps(m0, m1), _mm256_max_ps(m2, m3))));
  for (i = 0; i + 8 <= n; i += 8) {
    const int eq = _mm256_movemask_ps(_mm256_cmp_ps(load_bf16(row + i), top, _CMP_EQ_OQ));
    if (eq) return i + __builtin_ctz(eq);
  }
  const int eq = _mm256_movemask_ps(_mm256_cmp_ps(load_bf16_partial_neg_inf(row + i, n - i), top, _CMP_EQ_OQ));
  return eq ? i + __builtin_ctz(eq) : 0;  // (0: a row of -inf, whose padding also matched)
}

// RMSNorm as Hugging Face computes it: normalize in fp32, round to the model dtype, then
// multiply by the weight in the model dtype. Tails read as zeros (no effect on the sum).
void rms_norm_row_bf16(const uint16_t* x, const uint16_t* w, uint16_t* o, int64_t n, float eps) {
  __m256 sq0 = _mm256_setzero_ps(), sq1 = _mm256_setzero_ps();  // 16 lanes, as the AVX-512 set's
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256 a = load_bf16(x + i), b = load_bf16(x + i + 8);
    sq0 = _mm256_fmadd_ps(a, a, sq0);
    sq1 = _mm256_fmadd_ps(b, b, sq1);
  }
  for (; i < n; i += 8) {
    const __m256 a = n - i >= 8 ? load_bf16(x + i) : load_bf16_partial(x + i, n - i);
    sq0 = _mm256_fmadd_ps(a, a, sq0);
  }
  const __m256 inv = _mm256_set1_ps(1.f / std::sqrt(hsum(_mm256_add_ps(sq0, sq1)) / static_cast<float>(n) + eps));
  for (i = 0; i + 8 <= n; i += 8)
    store_bf16(o + i, _mm256_mul_ps(load_bf16(w + i), round_bf16(_mm256_mul_ps(load_bf16(x + i), inv))));
  if (i < n) {
    const __m256 y = _mm256_mul_ps(load_bf16_partial(w + i, n - i),
                                   round_bf16(_mm256_mul_ps(load_bf16_partial(x + i, n - i), inv)));
    store_bf16_partial(o + i, y, n - i);
  }
}

// residual += x, rounded once, as `residual + x`
void add_row_bf16(uint16_t* residual, const uint16_t* x, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) store_bf16(residual + i, _mm256_add_ps(load_bf16(residual + i), load_bf16(x + i)));
  if (i < n)
    store_bf16_partial(residual + i,
                       _mm256_add_ps(load_bf16_partial(residual + i, n - i), load_bf16_partial(x + i, n - i)), n - i);
}

// One row of neox rotary, head_dim a multiple of 32 (so each half is whole vectors). With
// cos_sin = [cos, cos], [-sin, sin] (models/layers.py): x1' = x1 cos + x2 (-sin) and
// x2' = x2 cos + x1 sin, each product and the sum rounded to bf16, as `x * cos + swapped * sin`
// does; fp32 products of two bf16 are exact, so this is PyTorch's result bit for bit.
void rotary_row_bf16(uint16_t* row, const uint16_t* cos, int64_t num_heads, int64_t d) {
  const int64_t half = d / 2;
  const uint16_t* sin = cos + d;
  for (int64_t h = 0; h < num_heads; ++h) {
    uint16_t* v = row + h * d;
    for (int64_t i = 0; i < half; i += 8) {
      const __m256 x1 = load_bf16(v + i), x2 = load_bf16(v + half + i);
      const __m256 lo = _mm256_add_ps(round_bf16(_mm256_mul_ps(x1, load_bf16(cos + i))),
                                      round_bf16(_mm256_mul_ps(x2, load_bf16(sin + i))));
      const __m256 hi = _mm256_add_ps(round_bf16(_mm256_mul_ps(x2, load_bf16(cos + half + i))),
                                      round_bf16(_mm256_mul_ps(x1, load_bf16(sin + half + i))));
      store_bf16(v + i, lo);
      store_bf16(v + half + i, hi);
    }
  }
}

// silu(g) * u with the two roundings of `F.silu(gate) * up`: silu rounded to bf16, then the product.
// Below -88.72 PyTorch's exp(-g) overflows to inf and silu is 0; exp_any clamps instead, so those
// gates are zeroed here (else a tiny nonzero).
inline __m256 silu_mul(__m256 g, __m256 u) {
  const __m256 e = exp_any(_mm256_sub_ps(_mm256_setzero_ps(), g));
  __m256 silu = _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.f), e));
  silu = _mm256_andnot_ps(_mm256_cmp_ps(g, _mm256_set1_ps(-88.7228394f), _CMP_LT_OQ), silu);  // NaN kept
  return _mm256_mul_ps(round_bf16(silu), u);
}

// x = [gate | up] (the gate_up_proj output row)
void silu_and_mul_row_bf16(const uint16_t* gate, uint16_t* o, int64_t n) {
  const uint16_t* up = gate + n;
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) store_bf16(o + i, silu_mul(load_bf16(gate + i), load_bf16(up + i)));
  if (i < n)
    store_bf16_partial(o + i, silu_mul(load_bf16_partial(gate + i, n - i), load_bf16_partial(up + i, n - i)), n - i);
}

}  // namespace

void argmax_bf16(const uint16_t* logits, int64_t ld, int64_t rows, int64_t v, int64_t* out) {
  parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) out[r] = argmax_row_bf16(logits + r * ld, v);
  });
}

void rms_norm_bf16(const uint16_t* x, int64_t ldx, const uint16_t* w, uint16_t* out, int64_t rows, int64_t n,
                   float eps) {
  parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) rms_norm_row_bf16(x + r * ldx, w, out + r * n, n, eps);
  });
}

// The norm reads the rounded sum back (from L1), so the result equals rms_norm_bf16 of it.
void add_rms_norm_bf16(uint16_t* residual, const uint16_t* x, int64_t ldx, const uint16_t* w, uint16_t* out,
                       int64_t rows, int64_t n, float eps) {
  parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      add_row_bf16(residual + r * n, x + r * ldx, n);
      rms_norm_row_bf16(residual + r * n, w, out + r * n, n, eps);
    }
  });
}

void rotary_bf16(uint16_t* x, int64_t ldx, const uint16_t* cos_sin, int64_t rows, int64_t num_heads, int64_t d) {
  parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) rotary_row_bf16(x + t * ldx, cos_sin + t * 2 * d, num_heads, d);
  });
}

void silu_and_mul_bf16(const uint16_t* x, int64_t ldx, uint16_t* out, int64_t rows, int64_t n) {
  parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) silu_and_mul_row_bf16(x + t * ldx, out + t * n, n);
  });
}

}  // namespace kvserve::avx2
