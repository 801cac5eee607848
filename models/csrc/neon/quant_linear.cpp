// The int8 / int4 linear on sdot dot products (see kernels.h and models/quantization.py).
#include "neon.h"

namespace kvserve::neon {

// ---- y[M, N] = x[M, K] @ (W[N, K] in groups of G along K).T (+ bias) ----------------------
// Weights: w = (u - offset) * scale[n, g], u unsigned (int8: u = q + 128; int4: u = q + 8 in
// 0..15), one fp16 scale per output column and group of G inputs. Packed as for the AVX-512 set
// (models/quantization.py), per block of 64 output columns, per step of 4 inputs:
//   int8: 256 bytes, the 64 columns' 4 bytes side by side;
//   int4: 128 bytes, columns 0-15 / 16-31 in the low / high nibbles of the first 64, 32-63 next.
// So 16 bytes are 4 columns x 4 inputs: one sdot (vdotq_laneq_s32) multiplies them by 4 inputs
// of one row. sdot is signed x signed: int8 weights become q by u ^ 0x80; int4 nibbles stay
// 0..15 and the offset is taken back per row and group (-8 * sum(q_x) preloaded into each
// group's accumulator), as the AVX-512 set does. Activations are quantized per row and group as
// there (Q8_0: scale amax/127, round to nearest even), so the int32 sums and the fp32 steps
// after them are the AVX-512 set's.

constexpr int kQuantTileM = 3;        // rows per register tile: 12 int32 + 12 fp32 accumulators
constexpr int64_t kQuantBlockM = 96;  // rows per work item

inline float32x4_t load4(const float* p) { return vld1q_f32(p); }
inline float32x4_t load4(const uint16_t* p) { return load_bf16(p); }

// One row's groups (G a multiple of 16): q_x (int8), the scale, and -offset * sum(q_x).
template <typename T>
void quantize_row(const T* x, int64_t k, int64_t group, int32_t offset, int8_t* q, float* d, int32_t* corr) {
  for (int64_t g = 0; g < k / group; ++g) {
    const T* src = x + g * group;
    float32x4_t amax = vdupq_n_f32(0.f);
    for (int64_t i = 0; i < group; i += 4) amax = vmaxq_f32(amax, vabsq_f32(load4(src + i)));
    const float scale = vmaxvq_f32(amax) / 127.f;
    const float inv = scale == 0.f ? 0.f : 1.f / scale;
    int32x4_t sum = vdupq_n_s32(0);
    for (int64_t i = 0; i < group; i += 8) {
      const int32x4_t a = vcvtnq_s32_f32(vmulq_n_f32(load4(src + i), inv));  // nearest even
      const int32x4_t b = vcvtnq_s32_f32(vmulq_n_f32(load4(src + i + 4), inv));
      sum = vaddq_s32(sum, vaddq_s32(a, b));
      vst1_s8(q + g * group + i, vqmovn_s16(vcombine_s16(vqmovn_s32(a), vqmovn_s32(b))));
    }
    d[g] = scale;
    corr[g] = -offset * vaddvq_s32(sum);
  }
}

template <typename T>
void quantize_rows(const T* x, int64_t ldx, int64_t m, int64_t k, int64_t group, int32_t offset, int8_t* q,
                   float* d, int32_t* corr) {
  const int64_t groups = k / group;
  parallel_for(0, m, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      quantize_row(x + r * ldx, k, group, offset, q + r * k, d + r * groups, corr + r * groups);
  });
}

// The 4 columns x 4 inputs of vector v (0..3) of 16-column group j, step st, as signed bytes
// (int4: group j is in the high nibbles when HIGH, j odd).
template <int BITS, bool HIGH>
inline int8x16_t weights(const uint8_t* w, int64_t st, int j, int v) {
  if constexpr (BITS == 8) {
    return vreinterpretq_s8_u8(veorq_u8(vld1q_u8(w + st * 256 + 64 * j + 16 * v), vdupq_n_u8(0x80)));
  } else {
    const uint8x16_t raw = vld1q_u8(w + st * 128 + 64 * (j / 2) + 16 * v);
    return vreinterpretq_s8_u8(HIGH ? vshrq_n_u8(raw, 4) : vandq_u8(raw, vdupq_n_u8(0x0F)));
  }
}

// s[i][v] += the 4 inputs of step st0 + L (lane L of xv[i]) times vector v's weights.
template <int MR, int BITS, bool HIGH, int L>
inline void dot_step(int32x4_t (&s)[MR][4], const int8x16_t (&xv)[MR], const uint8_t* w, int64_t st0, int j) {
  for (int v = 0; v < 4; ++v) {
    const int8x16_t wv = weights<BITS, HIGH>(w, st0 + L, j, v);
    for (int i = 0; i < MR; ++i) s[i][v] = vdotq_laneq_s32(s[i][v], wv, xv[i], L);
  }
}

// One MR x 16 tile, column group j (0..3) of a 64-column block, over all groups; then the
// bias, written to y (bf16 or fp32).
template <int MR, int BITS, bool HIGH>
void quant_tile(const int8_t* xq, int64_t k, const float* xd, const int32_t* xc, int64_t groups, const uint8_t* w,
                const uint16_t* ws, int64_t group, const float* bias, void* y, bool y_bf16, int64_t ldy,
                int64_t col0, int64_t n, int j) {
  const int64_t steps = group / 4;
  float32x4_t acc[MR][4];
  for (int i = 0; i < MR; ++i)
    for (int v = 0; v < 4; ++v) acc[i][v] = vdupq_n_f32(0.f);
  for (int64_t g = 0; g < groups; ++g) {
    int32x4_t s[MR][4];
    for (int i = 0; i < MR; ++i)
      for (int v = 0; v < 4; ++v) s[i][v] = vdupq_n_s32(xc[i * groups + g]);
    const uint8_t* wg = w + g * steps * (BITS == 8 ? 256 : 128);
    for (int64_t st = 0; st < steps; st += 4) {  // 16 inputs of each row: 4 steps
      int8x16_t xv[MR];
      for (int i = 0; i < MR; ++i) xv[i] = vld1q_s8(xq + i * k + g * group + 4 * st);
      dot_step<MR, BITS, HIGH, 0>(s, xv, wg, st, j);
      dot_step<MR, BITS, HIGH, 1>(s, xv, wg, st, j);
      dot_step<MR, BITS, HIGH, 2>(s, xv, wg, st, j);
      dot_step<MR, BITS, HIGH, 3>(s, xv, wg, st, j);
    }
    for (int v = 0; v < 4; ++v) {
      const float32x4_t wsv = vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(ws + g * 64 + 16 * j + 4 * v)));
      for (int i = 0; i < MR; ++i)
        acc[i][v] = vfmaq_f32(acc[i][v], vcvtq_f32_s32(s[i][v]), vmulq_n_f32(wsv, xd[i * groups + g]));
    }
  }
  for (int v = 0; v < 4; ++v) {
    const int64_t c = col0 + 16 * j + 4 * v, width = std::min<int64_t>(4, n - c);
    if (width <= 0) break;
    const float32x4_t b = !bias ? vdupq_n_f32(0.f) : width == 4 ? vld1q_f32(bias + c) : load_f32_partial(bias + c, width, 0.f);
    for (int i = 0; i < MR; ++i) {
      const float32x4_t out = vaddq_f32(acc[i][v], b);
      if (y_bf16) {
        uint16_t* yr = static_cast<uint16_t*>(y) + i * ldy + c;
        if (width == 4) store_bf16(yr, out);
        else store_bf16_partial(yr, out, width);
      } else {
        float* yr = static_cast<float*>(y) + i * ldy + c;
        if (width == 4) {
          vst1q_f32(yr, out);
        } else {
          float tmp[4];
          vst1q_f32(tmp, out);
          std::memcpy(yr, tmp, width * sizeof(float));
        }
      }
    }
  }
}

using QuantTileFn = decltype(&quant_tile<1, 8, false>);

template <int BITS, bool HIGH>
QuantTileFn quant_tile_fn(int mr) {
  switch (mr) {
    case 1: return quant_tile<1, BITS, HIGH>;
    case 2: return quant_tile<2, BITS, HIGH>;
    default: return quant_tile<3, BITS, HIGH>;
  }
}

inline QuantTileFn pick_quant_tile(int64_t bits, int j, int mr) {
  if (bits == 8) return quant_tile_fn<8, false>(mr);
  return j % 2 ? quant_tile_fn<4, true>(mr) : quant_tile_fn<4, false>(mr);
}

void quant_linear(const void* x, bool x_bf16, int64_t ldx, int64_t m, int64_t k, const uint8_t* wp,
                  const uint16_t* sp, int64_t bits, int64_t group, const float* bias, void* y, int64_t n,
                  int64_t col_blocks) {
  const int64_t groups = k / group;
  // The activations, quantized once for all column blocks, into this calling thread's scratch
  // (kept between calls: an allocation per call costs as much as a small matrix's work at batch 1).
  thread_local std::vector<int32_t> scratch;
  const int64_t q_words = (m * k + 3) / 4;
  scratch.resize(std::max<size_t>(scratch.size(), q_words + 2 * m * groups));
  int8_t* xqp = reinterpret_cast<int8_t*>(scratch.data());
  float* xdp = reinterpret_cast<float*>(scratch.data() + q_words);
  int32_t* xcp = scratch.data() + q_words + m * groups;
  const int32_t offset = bits == 8 ? 0 : 8;  // int8 weights are made signed, int4 nibbles are not
  if (x_bf16)
    quantize_rows(static_cast<const uint16_t*>(x), ldx, m, k, group, offset, xqp, xdp, xcp);
  else
    quantize_rows(static_cast<const float*>(x), ldx, m, k, group, offset, xqp, xdp, xcp);
  const bool y_bf16 = x_bf16;
  char* yp = static_cast<char*>(y);
  const int64_t y_item = y_bf16 ? 2 : 4, step_bytes = bits == 8 ? 256 : 128;
  // Work items (block of rows, 64-column block), as in linear_bf16; a matrix with fewer column
  // blocks than about 8 per thread, not a multiple of the thread count, is cut into halves.
  const int64_t threads = num_threads();
  const bool halves = col_blocks < 8 * threads && col_blocks % threads != 0;
  const int64_t col_items = halves ? 2 * col_blocks : col_blocks;
  const int64_t rows_per_item = linear_rows_per_item(m, col_items, kQuantTileM, kQuantBlockM);
  const int64_t row_items = (m + rows_per_item - 1) / rows_per_item;
  parallel_for(0, row_items * col_items, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t r0 = (item % row_items) * rows_per_item, ci = item / row_items;
      const int64_t cb = halves ? ci / 2 : ci;
      const int j0 = halves ? 2 * (int)(ci % 2) : 0, j1 = halves ? j0 + 2 : 4;
      const int64_t r1 = std::min(m, r0 + rows_per_item);
      const uint8_t* w = wp + cb * (k / 4) * step_bytes;
      const uint16_t* ws = sp + cb * groups * 64;
      for (int j = j0; j < j1 && cb * 64 + 16 * j < n; ++j)
        for (int64_t r = r0; r < r1; r += kQuantTileM) {
          const int mr = (int)std::min<int64_t>(kQuantTileM, r1 - r);
          pick_quant_tile(bits, j, mr)(xqp + r * k, k, xdp + r * groups, xcp + r * groups, groups, w, ws, group,
                                       bias, yp + r * n * y_item, y_bf16, n, cb * 64, n, j);
        }
    }
  });
}

}  // namespace kvserve::neon
