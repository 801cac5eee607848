// The fused per-layer ops: argmax, RMSNorm (+ residual add), KV-cache write, rotary, silu*mul;
// and the structured-output bitmask applied to logits.
#pragma once

#include <ATen/Dispatch.h>

#include "common.h"

namespace kvserve {

// ---- greedy argmax over bf16 logits ---------------------------------------------------
// torch.argmax on [B, vocab] bf16 runs one row at a time without SIMD, a visible share of a
// batch-64 step over a 49k vocabulary. Same result: the first index of the maximum (rows without NaN).

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

at::Tensor argmax_bf16(const at::Tensor& logits) {
  TORCH_CHECK(has_avx512_bf16(), "argmax_bf16 needs AVX-512");
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kBFloat16 && logits.stride(1) == 1 &&
                  logits.size(1) > 0 && logits.size(1) < (int64_t{1} << 31),
              "argmax_bf16: logits must be [B, V] bf16 rows");
  at::Tensor out = at::empty({logits.size(0)}, logits.options().dtype(at::kLong));
  const auto* base = reinterpret_cast<const uint16_t*>(logits.data_ptr<at::BFloat16>());
  int64_t* dst = out.data_ptr<int64_t>();
  at::parallel_for(0, logits.size(0), 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) dst[r] = argmax_row_bf16(base + r * logits.stride(0), logits.size(1));
  });
  return out;
}

// ---- small per-layer ops, fused ----------------------------------------------------
// Each replaces several PyTorch ops (and their dispatch) per layer; at batch 1 the
// dispatch costs more than the arithmetic. Both keep the model-dtype rounding steps
// of the PyTorch code they replace (see models/layers.py).

// RMSNorm as Hugging Face computes it: normalize in fp32, round to the model dtype,
// then multiply by the weight in the model dtype. x [T, N] rows (N contiguous).
template <typename T>
void rms_norm_rows(const T* x, int64_t ldx, const T* w, T* out, int64_t rows, int64_t n, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * ldx;
      T* o = out + r * n;
      float sum = 0.f;
      for (int64_t i = 0; i < n; ++i) {
        const float v = static_cast<float>(xr[i]);
        sum += v * v;
      }
      const float inv = 1.f / std::sqrt(sum / static_cast<float>(n) + eps);
      for (int64_t i = 0; i < n; ++i)
        o[i] = round_to<T>(static_cast<float>(w[i]) * static_cast<float>(round_to<T>(static_cast<float>(xr[i]) * inv)));
    }
  });
}

void rms_norm_rows_bf16(const uint16_t* x, int64_t ldx, const uint16_t* w, uint16_t* out, int64_t rows, int64_t n,
                        float eps);  // AVX-512, below

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && weight.is_contiguous() && weight.numel() == x.size(1) &&
                  x.scalar_type() == weight.scalar_type(), "rms_norm: x [T, N] rows and weight [N] of one dtype");
  at::Tensor out = at::empty({x.size(0), x.size(1)}, x.options());
  if (x.scalar_type() == at::kBFloat16 && has_avx512_bf16()) {
    rms_norm_rows_bf16(reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()), x.stride(0),
                       reinterpret_cast<const uint16_t*>(weight.data_ptr<at::BFloat16>()),
                       reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()), x.size(0), x.size(1),
                       static_cast<float>(eps));
  } else if (x.scalar_type() == at::kBFloat16) {
    rms_norm_rows(x.data_ptr<at::BFloat16>(), x.stride(0), weight.data_ptr<at::BFloat16>(),
                  out.data_ptr<at::BFloat16>(), x.size(0), x.size(1), static_cast<float>(eps));
  } else {
    TORCH_CHECK(x.scalar_type() == at::kFloat, "rms_norm supports float32 and bfloat16");
    rms_norm_rows(x.data_ptr<float>(), x.stride(0), weight.data_ptr<float>(), out.data_ptr<float>(), x.size(0),
                  x.size(1), static_cast<float>(eps));
  }
  return out;
}

// The pre-norm residual step of a decoder layer, fused: residual += x (rounded to the
// model dtype, as `residual + x` is), then the RMSNorm above of the new residual.
template <typename T>
void add_rows(T* residual, const T* x, int64_t ldx, int64_t rows, int64_t n) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      for (int64_t i = 0; i < n; ++i)
        residual[r * n + i] = round_to<T>(static_cast<float>(residual[r * n + i]) + static_cast<float>(x[r * ldx + i]));
  });
}

void add_rms_norm_rows_bf16(uint16_t* residual, const uint16_t* x, int64_t ldx, const uint16_t* w, uint16_t* out,
                            int64_t rows, int64_t n, float eps);  // AVX-512, below

at::Tensor add_rms_norm_(const at::Tensor& residual, const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(residual.dim() == 2 && residual.is_contiguous() && x.dim() == 2 && x.stride(1) == 1 &&
                  x.sizes() == residual.sizes() && weight.is_contiguous() && weight.numel() == x.size(1) &&
                  x.scalar_type() == residual.scalar_type() && x.scalar_type() == weight.scalar_type(),
              "add_rms_norm_: residual [T, N] contiguous, x [T, N] rows and weight [N] of one dtype");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "add_rms_norm_ supports bfloat16");
  at::Tensor out = at::empty({x.size(0), x.size(1)}, x.options());
  auto* res = reinterpret_cast<uint16_t*>(residual.data_ptr<at::BFloat16>());
  const auto* w = reinterpret_cast<const uint16_t*>(weight.data_ptr<at::BFloat16>());
  if (has_avx512_bf16()) {
    add_rms_norm_rows_bf16(res, reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()), x.stride(0), w,
                           reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()), x.size(0), x.size(1),
                           static_cast<float>(eps));
  } else {
    add_rows(residual.data_ptr<at::BFloat16>(), x.data_ptr<at::BFloat16>(), x.stride(0), x.size(0), x.size(1));
    rms_norm_rows(residual.data_ptr<at::BFloat16>(), x.size(1), weight.data_ptr<at::BFloat16>(),
                  out.data_ptr<at::BFloat16>(), x.size(0), x.size(1), static_cast<float>(eps));
  }
  return out;
}

// The new tokens' keys and values into their cache slots (one op for both caches instead
// of two index_copy_ calls; per layer, the dispatch was most of their cost).
// k, v [T, KvH, D] with contiguous heads (any row stride); caches [blocks, block_size, KvH, D].
void write_kv_cache(const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache, const at::Tensor& v_cache,
                    const at::Tensor& slots) {
  TORCH_CHECK(k.dim() == 3 && k.sizes() == v.sizes() && k.stride(2) == 1 && k.stride(1) == k.size(2) &&
                  v.stride(2) == 1 && v.stride(1) == v.size(2),
              "write_kv_cache: k and v must be [T, KvH, D] with contiguous heads");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.sizes() == v_cache.sizes() &&
                  k_cache.dim() == 4 && k_cache.size(2) == k.size(1) && k_cache.size(3) == k.size(2),
              "write_kv_cache: caches must be contiguous [blocks, block_size, KvH, D] matching k");
  TORCH_CHECK(k.scalar_type() == k_cache.scalar_type() && v.scalar_type() == v_cache.scalar_type() &&
                  k.scalar_type() == v.scalar_type(), "write_kv_cache: one dtype for k, v and the caches");
  TORCH_CHECK(slots.dim() == 1 && slots.numel() == k.size(0) && slots.scalar_type() == at::kLong &&
                  slots.is_contiguous(), "write_kv_cache: slots must be int64 [T]");
  const int64_t rows = k.size(0), num_slots = k_cache.size(0) * k_cache.size(1);
  const int64_t row_bytes = k.size(1) * k.size(2) * k.element_size();
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < rows; ++t)
    TORCH_CHECK(slot[t] >= 0 && slot[t] < num_slots, "write_kv_cache: slot ", slot[t], " out of range");
  const char* ks = static_cast<const char*>(k.data_ptr());
  const char* vs = static_cast<const char*>(v.data_ptr());
  char* kd = static_cast<char*>(k_cache.data_ptr());
  char* vd = static_cast<char*>(v_cache.data_ptr());
  const int64_t k_ld = k.stride(0) * k.element_size(), v_ld = v.stride(0) * v.element_size();
  at::parallel_for(0, rows, 256, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      std::memcpy(kd + slot[t] * row_bytes, ks + t * k_ld, row_bytes);
      std::memcpy(vd + slot[t] * row_bytes, vs + t * v_ld, row_bytes);
    }
  });
}

// Neox rotary in place on the first `num_heads` heads of each row of x [T, heads * D]
// (any row stride): x1' = x1 * cos - x2 * sin, x2' = x2 * cos + x1 * sin, with the
// cache layout of models/layers.py: cos_sin[t] = [cos, cos], [-sin, sin]. Each product
// and the sum are rounded to the model dtype, as `x * cos + swapped * sin` does.
template <typename T>
void rotary_rows(T* x, int64_t ldx, const T* cos_sin, int64_t rows, int64_t num_heads, int64_t d) {
  const int64_t half = d / 2;
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* cos = cos_sin + t * 2 * d;
      const T* sin = cos + d;
      for (int64_t h = 0; h < num_heads; ++h) {
        T* v = x + t * ldx + h * d;
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = static_cast<float>(v[i]), x2 = static_cast<float>(v[i + half]);
          const float lo = static_cast<float>(round_to<T>(x1 * static_cast<float>(cos[i]))) +
                           static_cast<float>(round_to<T>(x2 * static_cast<float>(sin[i])));
          const float hi = static_cast<float>(round_to<T>(x2 * static_cast<float>(cos[i + half]))) +
                           static_cast<float>(round_to<T>(x1 * static_cast<float>(sin[i + half])));
          v[i] = round_to<T>(lo);
          v[i + half] = round_to<T>(hi);
        }
      }
    }
  });
}

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
    _mm256_mask_storeu_epi16(o + i, m, (__m256i)_mm512_cvtneps_pbh(y));
  }
}

void rms_norm_rows_bf16(const uint16_t* x, int64_t ldx, const uint16_t* w, uint16_t* out, int64_t rows, int64_t n,
                        float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) rms_norm_row_bf16(x + r * ldx, w, out + r * n, n, eps);
  });
}

KV_AVX512_BF16 void add_row_bf16(uint16_t* residual, const uint16_t* x, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = n - i >= 16 ? 0xFFFF : (__mmask16)((1u << (n - i)) - 1);
    const __m512 r = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, residual + i)), 16));
    const __m512 v = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, x + i)), 16));
    _mm256_mask_storeu_epi16(residual + i, m, (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(r, v)));
  }
}

void add_rms_norm_rows_bf16(uint16_t* residual, const uint16_t* x, int64_t ldx, const uint16_t* w, uint16_t* out,
                            int64_t rows, int64_t n, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
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
      _mm256_storeu_si256((__m256i*)(v + i), (__m256i)_mm512_cvtneps_pbh(lo));
      _mm256_storeu_si256((__m256i*)(v + half + i), (__m256i)_mm512_cvtneps_pbh(hi));
    }
  }
}

void rotary_rows_bf16(uint16_t* x, int64_t ldx, const uint16_t* cos_sin, int64_t rows, int64_t num_heads,
                      int64_t d) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) rotary_row_bf16(x + t * ldx, cos_sin + t * 2 * d, num_heads, d);
  });
}

void rotary_(const at::Tensor& x, const at::Tensor& cos_sin, int64_t num_heads, int64_t head_dim) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) >= num_heads * head_dim && head_dim % 2 == 0,
              "rotary_: x must be [T, >= heads * D] rows");
  TORCH_CHECK(cos_sin.is_contiguous() && cos_sin.dim() == 3 && cos_sin.size(0) == x.size(0) &&
                  cos_sin.size(1) == 2 && cos_sin.size(2) == head_dim && cos_sin.scalar_type() == x.scalar_type(),
              "rotary_: cos_sin must be [T, 2, D] in x's dtype");
  if (x.scalar_type() == at::kBFloat16 && has_avx512_bf16() && head_dim % 32 == 0) {
    rotary_rows_bf16(reinterpret_cast<uint16_t*>(x.data_ptr<at::BFloat16>()), x.stride(0),
                     reinterpret_cast<const uint16_t*>(cos_sin.data_ptr<at::BFloat16>()), x.size(0), num_heads,
                     head_dim);
  } else if (x.scalar_type() == at::kBFloat16) {
    rotary_rows(x.data_ptr<at::BFloat16>(), x.stride(0), cos_sin.data_ptr<at::BFloat16>(), x.size(0), num_heads,
                head_dim);
  } else {
    TORCH_CHECK(x.scalar_type() == at::kFloat, "rotary_ supports float32 and bfloat16");
    rotary_rows(x.data_ptr<float>(), x.stride(0), cos_sin.data_ptr<float>(), x.size(0), num_heads, head_dim);
  }
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
    _mm256_mask_storeu_epi16(o + i, m, (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(round_bf16(silu), u)));
  }
}

void silu_and_mul_rows_bf16(const uint16_t* x, int64_t ldx, uint16_t* out, int64_t rows, int64_t n) {
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) silu_and_mul_row_bf16(x + t * ldx, out + t * n, n);
  });
}

at::Tensor silu_and_mul(const at::Tensor& x) {
  TORCH_CHECK(has_avx512_bf16(), "silu_and_mul needs AVX512-BF16");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) % 2 == 0 && x.scalar_type() == at::kBFloat16,
              "silu_and_mul: x must be [T, 2 * I] bf16 rows");
  const int64_t n = x.size(1) / 2;
  at::Tensor out = at::empty({x.size(0), n}, x.options());
  silu_and_mul_rows_bf16(reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()), x.stride(0),
                         reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()), x.size(0), n);
  return out;
}

// ---- structured outputs: a token bitmask onto the logits --------------------------------
// Bit j of word w of a row's mask allows token 32w + j; every other token of that row gets
// -inf. Words wholly allowed are skipped and banned bits are visited one by one, so the cost
// follows the number of banned tokens, as xgrammar's CPU kernel's does (benchmarks/bench_structured.py).
template <typename T>
void apply_token_bitmask_rows(T* logits, int64_t ld, int64_t vocab, const uint32_t* mask, int64_t words,
                              const int64_t* rows, int64_t num_rows) {
  const T neg_inf = static_cast<T>(-INFINITY);
  at::parallel_for(0, num_rows, 8, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      T* row = logits + rows[i] * ld;
      const uint32_t* m = mask + rows[i] * words;
      for (int64_t w = 0; w * 32 < vocab; ++w) {
        uint32_t banned = w < words ? ~m[w] : 0xFFFFFFFFu;  // ids past the mask are banned
        const int64_t base = w * 32;
        if (vocab - base < 32) {
          banned &= (1u << (vocab - base)) - 1;
        } else if (banned == 0xFFFFFFFFu) {  // a wholly banned word: one contiguous fill
          std::fill_n(row + base, 32, neg_inf);
          continue;
        }
        for (; banned != 0; banned &= banned - 1) row[base + __builtin_ctz(banned)] = neg_inf;
      }
    }
  });
}

void apply_token_bitmask_(const at::Tensor& logits, const at::Tensor& bitmask, const at::Tensor& rows) {
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1, "apply_token_bitmask_: logits must be [B, V] rows");
  TORCH_CHECK(bitmask.dim() == 2 && bitmask.is_contiguous() && bitmask.scalar_type() == at::kInt &&
                  bitmask.size(0) == logits.size(0),
              "apply_token_bitmask_: bitmask must be a contiguous [B, W] int32 tensor");
  TORCH_CHECK(rows.dim() == 1 && rows.is_contiguous() && rows.scalar_type() == at::kLong,
              "apply_token_bitmask_: rows must be a 1-D int64 tensor");
  const int64_t* r = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < rows.size(0); ++i)
    TORCH_CHECK(r[i] >= 0 && r[i] < logits.size(0), "apply_token_bitmask_: row ", r[i], " out of range");
  const auto* mask = reinterpret_cast<const uint32_t*>(bitmask.data_ptr<int32_t>());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logits.scalar_type(), "apply_token_bitmask_", [&] {
    apply_token_bitmask_rows<scalar_t>(logits.data_ptr<scalar_t>(), logits.stride(0), logits.size(1), mask,
                                       bitmask.size(1), r, rows.size(0));
  });
}

}  // namespace kvserve
