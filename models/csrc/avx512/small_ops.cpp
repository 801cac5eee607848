// The fused per-layer ops on bf16 rows and the greedy argmax (kernels.h). Each keeps the
// model-dtype rounding steps of the PyTorch code it replaces (models/layers.py).
#include "avx512.h"

namespace kvserve::avx512 {

// torch.argmax on [B, vocab] bf16 runs one row at a time without SIMD. Same result: the first
// index of the maximum (rows without NaN).
KV_AVX512_BF16 int64_t argmax_row_bf16(const uint16_t* row, int64_t n) {
  __m512 best = _mm512_set1_ps(-INFINITY);
  __m512i best_idx = _mm512_setzero_si512();
  __m512i idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i step = _mm512_set1_epi32(16);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = n - i >= 16 ? 0xFFFF : (__mmask16)((1u << (n - i)) - 1);
    const __m256i raw = _mm256_maskz_loadu_epi16(m, row + i);
    const __m512 v = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
    const __mmask16 better = _mm512_mask_cmp_ps_mask(m, v, best, _CMP_GT_OQ);  // strict: keeps the first
    best = _mm512_mask_blend_ps(better, best, v);
    best_idx = _mm512_mask_blend_epi32(better, best_idx, idx);
    idx = _mm512_add_epi32(idx, step);
  }
  const float top = _mm512_reduce_max_ps(best);
  const __mmask16 at_top = _mm512_cmp_ps_mask(best, _mm512_set1_ps(top), _CMP_EQ_OQ);
  return _mm512_mask_reduce_min_epi32(at_top, best_idx);
}

void argmax_bf16(const uint16_t* logits, int64_t ld, int64_t rows, int64_t v, int64_t* out) {
  parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) out[r] = argmax_row_bf16(logits + r * ld, v);
  });
}

// RMSNorm as Hugging Face computes it: normalize in fp32, round to the model dtype, then
// multiply by the weight in the model dtype; the residual add rounded once, as `residual + x`.
KV_AVX512_BF16 void rms_norm_row_bf16(const uint16_t* x, const uint16_t* w, uint16_t* o, int64_t n, float eps) {
  __m512 sq = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = n - i >= 16 ? 0xFFFF : (__mmask16)((1u << (n - i)) - 1);
    const __m512 v = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, x + i)), 16));
    sq = _mm512_fmadd_ps(v, v, sq);
  }
  const __m512 inv = _mm512_set1_ps(1.f / std::sqrt(_mm512_reduce_add_ps(sq) / static_cast<float>(n) + eps));
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = n - i >= 16 ? 0xFFFF : (__mmask16)((1u << (n - i)) - 1);
    const __m512 v = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, x + i)), 16));
    const __m512 wv = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, w + i)), 16));
    const __m512 y = _mm512_mul_ps(wv, round_bf16(_mm512_mul_ps(v, inv)));
    _mm256_mask_storeu_epi16(o + i, m, to_bf16(y));
  }
}

void rms_norm_bf16(const uint16_t* x, int64_t ldx, const uint16_t* w, uint16_t* out, int64_t rows, int64_t n,
                        float eps) {
  parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) rms_norm_row_bf16(x + r * ldx, w, out + r * n, n, eps);
  });
}

KV_AVX512_BF16 void add_row_bf16(uint16_t* residual, const uint16_t* x, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = n - i >= 16 ? 0xFFFF : (__mmask16)((1u << (n - i)) - 1);
    const __m512 r = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, residual + i)), 16));
    const __m512 v = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, x + i)), 16));
    _mm256_mask_storeu_epi16(residual + i, m, to_bf16(_mm512_add_ps(r, v)));
  }
}

void add_rms_norm_bf16(uint16_t* residual, const uint16_t* x, int64_t ldx, const uint16_t* w, uint16_t* out,
                            int64_t rows, int64_t n, float eps) {
  parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      add_row_bf16(residual + r * n, x + r * ldx, n);
      rms_norm_row_bf16(residual + r * n, w, out + r * n, n, eps);
    }
  });
}

// One row of rotary for bf16 with head_dim a multiple of 32: 16 pairs per step.
// (Per-row functions: a lambda inside a target-attributed function does not inherit it.)
KV_AVX512_BF16 void rotary_row_bf16(uint16_t* row, const uint16_t* cos, int64_t num_heads, int64_t d) {
  const int64_t half = d / 2;
  const uint16_t* sin = cos + d;
  for (int64_t h = 0; h < num_heads; ++h) {
    uint16_t* v = row + h * d;
    for (int64_t i = 0; i < half; i += 16) {
      const __m512 x1 = load_bf16_as_float(v + i), x2 = load_bf16_as_float(v + half + i);
      const __m512 lo = _mm512_add_ps(round_bf16(_mm512_mul_ps(x1, load_bf16_as_float(cos + i))),
                                      round_bf16(_mm512_mul_ps(x2, load_bf16_as_float(sin + i))));
      const __m512 hi = _mm512_add_ps(round_bf16(_mm512_mul_ps(x2, load_bf16_as_float(cos + half + i))),
                                      round_bf16(_mm512_mul_ps(x1, load_bf16_as_float(sin + half + i))));
      _mm256_storeu_si256((__m256i*)(v + i), to_bf16(lo));
      _mm256_storeu_si256((__m256i*)(v + half + i), to_bf16(hi));
    }
  }
}

void rotary_bf16(uint16_t* x, int64_t ldx, const uint16_t* cos_sin, int64_t rows, int64_t num_heads,
                      int64_t d) {
  parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) rotary_row_bf16(x + t * ldx, cos_sin + t * 2 * d, num_heads, d);
  });
}

// silu(gate) * up for x = [gate | up] rows of bf16 (the gate_up_proj output), with the two
// roundings of `F.silu(gate) * up`: silu rounded to bf16, then the product.
KV_AVX512_BF16 void silu_and_mul_row_bf16(const uint16_t* gate, uint16_t* o, int64_t n) {
  const uint16_t* up = gate + n;
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = n - i >= 16 ? 0xFFFF : (__mmask16)((1u << (n - i)) - 1);
    const __m512 g = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, gate + i)), 16));
    const __m512 u = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, up + i)), 16));
    const __m512 silu = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), exp_any(_mm512_sub_ps(_mm512_setzero_ps(), g))));
    _mm256_mask_storeu_epi16(o + i, m, to_bf16(_mm512_mul_ps(round_bf16(silu), u)));
  }
}

void silu_and_mul_bf16(const uint16_t* x, int64_t ldx, uint16_t* out, int64_t rows, int64_t n) {
  parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) silu_and_mul_row_bf16(x + t * ldx, out + t * n, n);
  });
}

}  // namespace kvserve::avx512
