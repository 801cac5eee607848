// The int8 / int4 linear on VNNI dot products (see kernels.h and models/quantization.py).
#include "avx512.h"

namespace kvserve::avx512 {

// ---- y[M, N] = x[M, K] @ (W[N, K] in groups of G along K).T (+ bias) ----------------------
// Weights: w = (u - offset) * scale[n, g], u unsigned (int8: u = q + 128, offset 128;
// int4: u = q + 8 in 0..15, offset 8), one fp16 scale per output column and group of G inputs.
// Packed (models/quantization.py), per block of 64 output columns, per step of 4 inputs:
//   int8: 256 bytes, the 64 columns' 4 bytes side by side (4 vectors of 16 columns);
//   int4: 128 bytes, vectors 0 and 1 in the low / high nibbles of the first 64, 2 and 3 of the next.
// Scales [N/64][K/G][64] fp16.
// Activations are quantized per row and group like llama.cpp's Q8_0 (scale amax/127, round to
// nearest even), so one vpdpbusd multiplies 4 inputs by 16 columns in int32; the unsigned offset
// is taken back per row and group (-offset * sum(q_x) preloaded into each group's accumulator).

constexpr int kQuantTileM = 3;         // rows per register tile: 12 int32 + 12 fp32 accumulators
constexpr int64_t kQuantBlockM = 96;   // rows per work item

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) { return load_bf16_as_float(p); }

// One row's groups: q_x (int8), the scale, and -offset * sum(q_x).
template <typename T>
KV_AVX512_VNNI void quantize_row(const T* x, int64_t k, int64_t group, int32_t offset, int8_t* q, float* d,
                                 int32_t* corr) {
  for (int64_t g = 0; g < k / group; ++g) {
    const T* src = x + g * group;
    __m512 amax = _mm512_setzero_ps();
    for (int64_t i = 0; i < group; i += 16) amax = _mm512_max_ps(amax, _mm512_abs_ps(load16(src + i)));
    const float a = _mm512_reduce_max_ps(amax);
    const float scale = a / 127.f;
    const __m512 inv = _mm512_set1_ps(scale == 0.f ? 0.f : 1.f / scale);
    __m512i sum = _mm512_setzero_si512();
    for (int64_t i = 0; i < group; i += 16) {
      const __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(load16(src + i), inv));  // nearest even
      sum = _mm512_add_epi32(sum, v);
      _mm_storeu_si128((__m128i*)(q + g * group + i), _mm512_cvtsepi32_epi8(v));
    }
    d[g] = scale;
    corr[g] = -offset * _mm512_reduce_add_epi32(sum);
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

// One MR x 64 tile (NV = 4 vectors of 16 columns) of a 64-column block, over all groups; then the
// bias, written to y (bf16 or fp32). PREFETCH: the tile that brings an item's weights in fetches
// whole steps a few KiB ahead (one row streams the block; the hardware's prefetch alone lags).
template <int MR, int BITS, bool PREFETCH>
KV_AVX512_VNNI void quant_tile(const int8_t* xq, int64_t k, const float* xd, const int32_t* xc, int64_t groups,
                               const uint8_t* w, const uint16_t* ws, int64_t group, const float* bias, void* y,
                               bool y_bf16, int64_t ldy, int64_t col0, int64_t n) {
  constexpr int NV = 4;
  constexpr int64_t kStepBytes = BITS == 8 ? 256 : 128, kAhead = 4096;
  const int64_t steps = group / 4;
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  __m512 acc[MR][NV];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NV; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512i s[MR][NV];
    for (int i = 0; i < MR; ++i) {
      const __m512i c = _mm512_set1_epi32(xc[i * groups + g]);
      for (int j = 0; j < NV; ++j) s[i][j] = c;
    }
    const uint8_t* wg = w + g * steps * kStepBytes;
    const int8_t* xg = xq + g * group;
    for (int64_t st = 0; st < steps; ++st) {
      if (PREFETCH)
        for (int line = 0; line < kStepBytes / 64; ++line)
          _mm_prefetch((const char*)wg + st * kStepBytes + kAhead + 64 * line, _MM_HINT_T0);
      __m512i wv[NV];
      if constexpr (BITS == 8) {
        for (int j = 0; j < NV; ++j) wv[j] = _mm512_loadu_si512(wg + st * kStepBytes + 64 * j);
      } else {  // vectors 2h and 2h + 1 share the h-th 64 bytes (low and high nibbles)
        for (int h = 0; h < NV / 2; ++h) {
          const __m512i a = _mm512_loadu_si512(wg + st * kStepBytes + 64 * h);
          wv[2 * h] = _mm512_and_si512(a, low4);
          wv[2 * h + 1] = _mm512_and_si512(_mm512_srli_epi16(a, 4), low4);
        }
      }
      for (int i = 0; i < MR; ++i) {
        int32_t quad;
        std::memcpy(&quad, xg + i * k + 4 * st, sizeof(quad));
        const __m512i xv = _mm512_set1_epi32(quad);
        for (int j = 0; j < NV; ++j) s[i][j] = _mm512_dpbusd_epi32(s[i][j], wv[j], xv);
      }
    }
    __m512 wsv[NV];
    for (int j = 0; j < NV; ++j)
      wsv[j] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(ws + g * 64 + 16 * j)));
    for (int i = 0; i < MR; ++i) {
      const __m512 dx = _mm512_set1_ps(xd[i * groups + g]);
      for (int j = 0; j < NV; ++j)
        acc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[i][j]), _mm512_mul_ps(wsv[j], dx), acc[i][j]);
    }
  }
  for (int j = 0; j < NV; ++j) {
    const int64_t col = col0 + 16 * j;
    const int64_t width = std::min<int64_t>(16, n - col);
    if (width <= 0) break;
    const __mmask16 mask = width == 16 ? 0xFFFF : (__mmask16)((1u << width) - 1);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + col) : _mm512_setzero_ps();
    for (int i = 0; i < MR; ++i) {
      const __m512 out = _mm512_add_ps(acc[i][j], b);
      if (y_bf16)
        _mm256_mask_storeu_epi16((uint16_t*)y + i * ldy + col, mask, to_bf16(out));
      else
        _mm512_mask_storeu_ps((float*)y + i * ldy + col, mask, out);
    }
  }
}

using QuantTileFn = decltype(&quant_tile<1, 8, false>);

template <int BITS, bool PREFETCH>
QuantTileFn quant_tile_fn(int mr) {
  switch (mr) {
    case 1: return quant_tile<1, BITS, PREFETCH>;
    case 2: return quant_tile<2, BITS, PREFETCH>;
    default: return quant_tile<3, BITS, PREFETCH>;
  }
}

QuantTileFn pick_quant_tile(int64_t bits, bool prefetch, int mr) {
  if (bits == 8) return prefetch ? quant_tile_fn<8, true>(mr) : quant_tile_fn<8, false>(mr);
  return prefetch ? quant_tile_fn<4, true>(mr) : quant_tile_fn<4, false>(mr);
}

void quant_linear(const void* x, bool x_bf16, int64_t ldx, int64_t m, int64_t k, const uint8_t* wp,
                  const uint16_t* sp, int64_t bits, int64_t group, const float* bias_ptr, void* y, int64_t n,
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
  const int32_t offset = bits == 8 ? 128 : 8;
  if (x_bf16)
    quantize_rows(static_cast<const uint16_t*>(x), ldx, m, k, group, offset, xqp, xdp, xcp);
  else
    quantize_rows(static_cast<const float*>(x), ldx, m, k, group, offset, xqp, xdp, xcp);
  const bool y_bf16 = x_bf16;
  char* yp = static_cast<char*>(y);
  const int64_t y_item = y_bf16 ? 2 : 4, step_bytes = bits == 8 ? 256 : 128;
  // Work items (block of rows, 64-column block), as in linear_bf16, shared out at run time. A
  // matrix with few column blocks is not cut into half blocks: two threads reading alternate
  // cache lines of one block each pull both lines in (the adjacent-line prefetch).
  const int64_t rows_per_item = linear_rows_per_item(m, col_blocks, kQuantTileM, kQuantBlockM);
  const int64_t row_items = (m + rows_per_item - 1) / rows_per_item;
  parallel_items(row_items * col_blocks, [&](ItemQueue& queue) {
    for (int64_t item; queue.next(&item);) {
      const int64_t r0 = (item % row_items) * rows_per_item, cb = item / row_items;
      const int64_t r1 = std::min(m, r0 + rows_per_item);
      const uint8_t* w = wp + cb * (k / 4) * step_bytes;
      const uint16_t* ws = sp + cb * groups * 64;
      for (int64_t r = r0; r < r1; r += kQuantTileM) {
        const int mr = (int)std::min<int64_t>(kQuantTileM, r1 - r);
        pick_quant_tile(bits, r == r0 && prefetch_streams(), mr)(xqp + r * k, k, xdp + r * groups, xcp + r * groups, groups, w, ws, group,
                                           bias_ptr, yp + r * n * y_item, y_bf16, n, cb * 64, n);
      }
    }
  });
}

}  // namespace kvserve::avx512
