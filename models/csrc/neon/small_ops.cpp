// The fused per-layer ops on bf16 rows and the greedy argmax (kernels.h). Each keeps the
// model-dtype rounding steps of the PyTorch code it replaces (models/layers.py).
#include "neon.h"

namespace kvserve::neon {

// 4 bf16 at p + i as fp32, the first n - i of them when fewer than 4 remain (zeros after).
inline float32x4_t load_tail(const uint16_t* p, int64_t i, int64_t n) {
  return n - i >= 4 ? load_bf16(p + i) : load_bf16_partial(p + i, n - i);
}

inline void store_tail(uint16_t* p, int64_t i, int64_t n, float32x4_t v) {
  if (n - i >= 4) store_bf16(p + i, v);
  else store_bf16_partial(p + i, v, n - i);
}

// torch.argmax on [B, vocab] bf16: the first index of the maximum (rows without NaN).
int64_t argmax_row_bf16(const uint16_t* row, int64_t n) {
  float32x4_t best = vdupq_n_f32(-INFINITY);
  const uint32_t first[4] = {0, 1, 2, 3};
  uint32x4_t best_idx = vdupq_n_u32(0), idx = vld1q_u32(first);
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    const float32x4_t v = load_bf16(row + i);
    const uint32x4_t better = vcgtq_f32(v, best);  // strict: keeps the first
    best = vbslq_f32(better, v, best);
    best_idx = vbslq_u32(better, idx, best_idx);
    idx = vaddq_u32(idx, vdupq_n_u32(4));
  }
  const float top = vmaxvq_f32(best);
  // the lowest index holding the top among the lanes (lanes that never beat -inf hold 0)
  const uint32x4_t at_top = vceqq_f32(best, vdupq_n_f32(top));
  int64_t arg = n >= 4 ? vminvq_u32(vbslq_u32(at_top, best_idx, vdupq_n_u32(UINT32_MAX))) : 0;
  float top_tail = n >= 4 ? top : -INFINITY;
  for (; i < n; ++i) {
    const float v = bf16_to_float(row[i]);
    if (v > top_tail) top_tail = v, arg = i;
  }
  return arg;
}

void argmax_bf16(const uint16_t* logits, int64_t ld, int64_t rows, int64_t v, int64_t* out) {
  parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) out[r] = argmax_row_bf16(logits + r * ld, v);
  });
}

// RMSNorm as Hugging Face computes it: normalize in fp32, round to the model dtype, then
// multiply by the weight in the model dtype; the residual add rounded once, as `residual + x`.
void rms_norm_row_bf16(const uint16_t* x, const uint16_t* w, uint16_t* o, int64_t n, float eps) {
  float32x4_t sq = vdupq_n_f32(0.f);
  for (int64_t i = 0; i < n; i += 4) {
    const float32x4_t v = load_tail(x, i, n);
    sq = vfmaq_f32(sq, v, v);
  }
  const float inv = 1.f / std::sqrt(vaddvq_f32(sq) / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; i += 4) {
    const float32x4_t y = vmulq_f32(load_tail(w, i, n), round_bf16(vmulq_n_f32(load_tail(x, i, n), inv)));
    store_tail(o, i, n, y);
  }
}

void rms_norm_bf16(const uint16_t* x, int64_t ldx, const uint16_t* w, uint16_t* out, int64_t rows, int64_t n,
                   float eps) {
  parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) rms_norm_row_bf16(x + r * ldx, w, out + r * n, n, eps);
  });
}

void add_rms_norm_bf16(uint16_t* residual, const uint16_t* x, int64_t ldx, const uint16_t* w, uint16_t* out,
                       int64_t rows, int64_t n, float eps) {
  parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      uint16_t* res = residual + r * n;
      const uint16_t* xr = x + r * ldx;
      for (int64_t i = 0; i < n; i += 4) store_tail(res, i, n, vaddq_f32(load_tail(res, i, n), load_tail(xr, i, n)));
      rms_norm_row_bf16(res, w, out + r * n, n, eps);
    }
  });
}

// Neox rotary on one row, head_dim a multiple of 32: each product rounded to bf16, then their
// sum (apply_rotary's bf16 ops; the products of two bf16 are exact in fp32).
void rotary_row_bf16(uint16_t* row, const uint16_t* cos, int64_t num_heads, int64_t d) {
  const int64_t half = d / 2;
  const uint16_t* sin = cos + d;
  for (int64_t h = 0; h < num_heads; ++h) {
    uint16_t* v = row + h * d;
    for (int64_t i = 0; i < half; i += 4) {
      const float32x4_t x1 = load_bf16(v + i), x2 = load_bf16(v + half + i);
      const float32x4_t lo = vaddq_f32(round_bf16(vmulq_f32(x1, load_bf16(cos + i))),
                                       round_bf16(vmulq_f32(x2, load_bf16(sin + i))));
      const float32x4_t hi = vaddq_f32(round_bf16(vmulq_f32(x2, load_bf16(cos + half + i))),
                                       round_bf16(vmulq_f32(x1, load_bf16(sin + half + i))));
      store_bf16(v + i, lo);
      store_bf16(v + half + i, hi);
    }
  }
}

void rotary_bf16(uint16_t* x, int64_t ldx, const uint16_t* cos_sin, int64_t rows, int64_t num_heads, int64_t d) {
  parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) rotary_row_bf16(x + t * ldx, cos_sin + t * 2 * d, num_heads, d);
  });
}

// silu(gate) * up for x = [gate | up] rows of bf16 (the gate_up_proj output), with the two
// roundings of `F.silu(gate) * up`: silu rounded to bf16, then the product.
void silu_and_mul_row_bf16(const uint16_t* gate, uint16_t* o, int64_t n) {
  const uint16_t* up = gate + n;
  for (int64_t i = 0; i < n; i += 4) {
    const float32x4_t g = load_tail(gate, i, n), u = load_tail(up, i, n);
    const float32x4_t silu = vdivq_f32(g, vaddq_f32(vdupq_n_f32(1.f), exp_any(vnegq_f32(g))));
    store_tail(o, i, n, vmulq_f32(round_bf16(silu), u));
  }
}

void silu_and_mul_bf16(const uint16_t* x, int64_t ldx, uint16_t* out, int64_t rows, int64_t n) {
  parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) silu_and_mul_row_bf16(x + t * ldx, out + t * n, n);
  });
}

}  // namespace kvserve::neon
