// The int8 / int4 linear on AVX2 integer dot products (see kernels.h and models/quantization.py).
//
// Weights: w = (u - offset) * scale[n, g], u unsigned (int8: u = q + 128; int4: u = q + 8 in
// 0..15), one fp16 scale per output column and group of G inputs. Packed per block of 64 output
// columns, per step of 4 inputs: int8: 256 bytes, each column's 4 bytes side by side, so a
// 32-byte load is 8 columns (vector l = columns 8l..8l+7); int4: 128 bytes, where 32-byte load
// l = 2h + t holds columns 32h + 8t.. in its low nibbles and 32h + 16 + 8t.. in its high ones.
// Activations are quantized per row and group like llama.cpp's Q8_0 (scale amax/127, round to
// nearest even), exactly as the AVX-512 set does.
//
// vpmaddubsw multiplies unsigned by signed bytes into int16 pairs, saturating; vpmaddwd with ones
// then sums the pairs into int32 (4 inputs per column and lane). int8 makes the weights signed
// (q = u ^ 0x80) and multiplies |q| by x carrying q's sign (llama.cpp's trick): a pair is at most
// 2 * 128 * 127, within int16, for any q. int4 takes u as the unsigned operand (a pair at most
// 2 * 15 * 127, so 8 steps add up in int16 before one vpmaddwd) and takes back 8 * sum(x) per
// group. Group sums are exact integers; each meets scale * x_scale in one FMA per group, in the
// same order for every tile shape, so a row's result does not depend on the batch around it.
#include "avx2.h"

namespace kvserve::avx2 {
namespace {

constexpr int kQuantTileM = 4;        // rows per register tile
constexpr int64_t kQuantBlockM = 96;  // rows per work item
constexpr int kRowsTileM = 4;         // rows of the many-row tile (quant_tile_rows)

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) { return load_bf16(p); }

inline int32_t hsum_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1)));
}

// Chunks of up to 32 inputs (8 steps) per row: each group's own, the last one maybe shorter.
inline int64_t chunks_per_row(int64_t k, int64_t group) { return k / group * ((group + 31) / 32); }

// One row's groups: q_x (int8), the scale, and sum(q_x). group is a multiple of 16. With corr
// (int4's many-row tile): per chunk of up to 32 inputs of a group, -8 times the sums of the
// inputs at 0, 1 and at 2, 3 mod 4, as two int16 in one word (the halves of a vpmaddubsw lane pair).
template <typename T>
void quantize_row(const T* x, int64_t k, int64_t group, int8_t* q, float* d, int32_t* sums, int32_t* corr) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  for (int64_t g = 0; g < k / group; ++g) {
    const T* src = x + g * group;
    __m256 amax = _mm256_setzero_ps();
    for (int64_t i = 0; i < group; i += 8) amax = _mm256_max_ps(amax, _mm256_and_ps(load8(src + i), abs_mask));
    const float scale = hmax(amax) / 127.f;
    const __m256 inv = _mm256_set1_ps(scale == 0.f ? 0.f : 1.f / scale);
    __m256i sum = _mm256_setzero_si256(), chunk = sum, lo_half = sum;
    for (int64_t i = 0; i < group; i += 16) {
      const __m256i v0 = _mm256_cvtps_epi32(_mm256_mul_ps(load8(src + i), inv));  // nearest even
      const __m256i v1 = _mm256_cvtps_epi32(_mm256_mul_ps(load8(src + i + 8), inv));
      const __m256i v = _mm256_add_epi32(v0, v1);
      sum = _mm256_add_epi32(sum, v);
      if (corr) {
        chunk = _mm256_add_epi32(chunk, v);
        lo_half = _mm256_add_epi32(lo_half, _mm256_blend_epi32(_mm256_setzero_si256(), v, 0x33));
        if (i % 32 == 16 || i + 16 == group) {  // the chunk's end
          const int32_t all = hsum_epi32(chunk), lo = hsum_epi32(lo_half);
          corr[g * ((group + 31) / 32) + i / 32] = (int32_t)((uint32_t)(uint16_t)(-8 * lo) |
                                                             ((uint32_t)(uint16_t)(-8 * (all - lo)) << 16));
          chunk = lo_half = _mm256_setzero_si256();
        }
      }
      // saturating packs (per 128-bit lane), then the lanes back in order
      const __m256i p16 = _mm256_permute4x64_epi64(_mm256_packs_epi32(v0, v1), 0xD8);
      const __m128i p8 = _mm_packs_epi16(_mm256_castsi256_si128(p16), _mm256_extracti128_si256(p16, 1));
      _mm_storeu_si128((__m128i*)(q + g * group + i), p8);
    }
    d[g] = scale;
    sums[g] = hsum_epi32(sum);
  }
}

template <typename T>
void quantize_rows(const T* x, int64_t ldx, int64_t m, int64_t k, int64_t group, int8_t* q, float* d,
                   int32_t* sums, int32_t* corr) {
  const int64_t groups = k / group, chunks = chunks_per_row(k, group);
  parallel_for(0, m, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      quantize_row(x + r * ldx, k, group, q + r * k, d + r * groups, sums + r * groups, corr ? corr + r * chunks : nullptr);
  });
}

inline __m256i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof(v));
  return _mm256_set1_epi32(v);
}

// y[at .. at + width) (bf16 or fp32) = the first `width` lanes of v.
inline void store8(__m256 v, void* y, bool y_bf16, int64_t at, int64_t width) {
  if (y_bf16) {
    uint16_t* dst = static_cast<uint16_t*>(y) + at;
    width == 8 ? store_bf16(dst, v) : store_bf16_partial(dst, v, width);
  } else if (width == 8) {
    _mm256_storeu_ps(static_cast<float*>(y) + at, v);
  } else {
    alignas(32) float tmp[8];
    _mm256_store_ps(tmp, v);
    std::memcpy(static_cast<float*>(y) + at, tmp, width * sizeof(float));
  }
}

// MR rows x the columns of NL 32-byte weight loads from load l0 on (int8: NL vectors of 8
// columns, int4: 2 NL), over all groups; then the bias, written to y (bf16 or fp32). Registers
// in the step loop: the int32 (int8) or int16 (int4) sums, and either every row's broadcast
// (loads outer) or every load's weights (ROWS_OUTER). PREFETCH: the tile that brings an item's
// weights in prefetches whole steps a few KiB ahead (it may read only part of each line).
template <int MR, int BITS, int NL, bool ROWS_OUTER, bool PREFETCH>
void quant_tile(const int8_t* xq, int64_t k, const float* xd, const int32_t* xs, int64_t groups, const uint8_t* w,
                const uint16_t* ws, int64_t group, const float* bias, void* y, bool y_bf16, int64_t ldy,
                int64_t col0, int64_t n, int l0) {
  constexpr int NV = BITS == 8 ? NL : 2 * NL;
  constexpr int64_t kStepBytes = BITS == 8 ? 256 : 128, kAhead = 4096;
  int vec[NV];  // the block's 8-column vector of each result
  KV_UNROLL for (int l = 0; l < NL; ++l) {
    if (BITS == 8) {
      vec[l] = l0 + l;
    } else {
      const int h = (l0 + l) / 2, t = (l0 + l) % 2;
      vec[2 * l] = 4 * h + t, vec[2 * l + 1] = 4 * h + 2 + t;
    }
  }
  const int64_t steps = group / 4;
  const __m256i ones = _mm256_set1_epi16(1), flip = _mm256_set1_epi8((char)0x80), low4 = _mm256_set1_epi8(0x0F);
  __m256 acc[MR][NV];
  KV_UNROLL for (int i = 0; i < MR; ++i) {
    KV_UNROLL for (int j = 0; j < NV; ++j) acc[i][j] = _mm256_setzero_ps();
  }
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* wg = w + g * steps * kStepBytes;
    const int8_t* xg = xq + g * group;
    __m256i s[MR][NV];
    KV_UNROLL for (int i = 0; i < MR; ++i) {
      KV_UNROLL for (int j = 0; j < NV; ++j) s[i][j] = _mm256_set1_epi32(BITS == 8 ? 0 : -8 * xs[i * groups + g]);
    }
    if constexpr (BITS == 8) {
      for (int64_t st = 0; st < steps; ++st) {
        const uint8_t* ws8 = wg + st * kStepBytes;
        if (PREFETCH)
          for (int line = 0; line < 4; ++line) _mm_prefetch((const char*)ws8 + kAhead + 64 * line, _MM_HINT_T0);
        __m256i q[NL], aq[NL];
        KV_UNROLL for (int l = 0; l < NL; ++l) {
          q[l] = _mm256_xor_si256(_mm256_loadu_si256((const __m256i*)(ws8 + 32 * (l0 + l))), flip);
          aq[l] = _mm256_abs_epi8(q[l]);
          if (!ROWS_OUTER) {
            KV_UNROLL for (int i = 0; i < MR; ++i) {
              const __m256i p = _mm256_maddubs_epi16(aq[l], _mm256_sign_epi8(bcast4(xg + i * k + 4 * st), q[l]));
              s[i][l] = _mm256_add_epi32(s[i][l], _mm256_madd_epi16(p, ones));
            }
          }
        }
        if (ROWS_OUTER) {
          KV_UNROLL for (int i = 0; i < MR; ++i) {
            const __m256i xb = bcast4(xg + i * k + 4 * st);
            KV_UNROLL for (int l = 0; l < NL; ++l) {
              const __m256i p = _mm256_maddubs_epi16(aq[l], _mm256_sign_epi8(xb, q[l]));
              s[i][l] = _mm256_add_epi32(s[i][l], _mm256_madd_epi16(p, ones));
            }
          }
        }
      }
    } else {
      for (int64_t st0 = 0; st0 < steps; st0 += 8) {  // int16 sums of up to 8 steps
        __m256i h[MR][NV];
        KV_UNROLL for (int i = 0; i < MR; ++i) {
          KV_UNROLL for (int j = 0; j < NV; ++j) h[i][j] = _mm256_setzero_si256();
        }
        for (int64_t st = st0; st < std::min(steps, st0 + 8); ++st) {
          const uint8_t* ws4 = wg + st * kStepBytes;
          if (PREFETCH)
            for (int line = 0; line < 2; ++line) _mm_prefetch((const char*)ws4 + kAhead + 64 * line, _MM_HINT_T0);
          KV_UNROLL for (int l = 0; l < NL; ++l) {
            const __m256i a = _mm256_loadu_si256((const __m256i*)(ws4 + 32 * (l0 + l)));
            const __m256i lo = _mm256_and_si256(a, low4), hi = _mm256_and_si256(_mm256_srli_epi16(a, 4), low4);
            KV_UNROLL for (int i = 0; i < MR; ++i) {
              const __m256i xb = bcast4(xg + i * k + 4 * st);
              h[i][2 * l] = _mm256_add_epi16(h[i][2 * l], _mm256_maddubs_epi16(lo, xb));
              h[i][2 * l + 1] = _mm256_add_epi16(h[i][2 * l + 1], _mm256_maddubs_epi16(hi, xb));
            }
          }
        }
        KV_UNROLL for (int i = 0; i < MR; ++i) {
          KV_UNROLL for (int j = 0; j < NV; ++j) s[i][j] = _mm256_add_epi32(s[i][j], _mm256_madd_epi16(h[i][j], ones));
        }
      }
    }
    KV_UNROLL for (int j = 0; j < NV; ++j) {
      const __m256 wsv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(ws + g * 64 + 8 * vec[j])));
      KV_UNROLL for (int i = 0; i < MR; ++i) {
        const __m256 dx = _mm256_set1_ps(xd[i * groups + g]);
        acc[i][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[i][j]), _mm256_mul_ps(wsv, dx), acc[i][j]);
      }
    }
  }
  for (int j = 0; j < NV; ++j) {
    const int64_t col = col0 + 8 * vec[j], width = std::min<int64_t>(8, n - col);
    if (width <= 0) continue;
    alignas(32) float b[8] = {};
    if (bias) std::memcpy(b, bias + col, width * sizeof(float));
    for (int i = 0; i < MR; ++i) store8(_mm256_add_ps(acc[i][j], _mm256_load_ps(b)), y, y_bf16, i * ldy + col, width);
  }
}

// The many-row tile: R rows x 16 columns (slice l0 of a 64-column block: int4 the low and high
// nibbles of the step's 32-byte load l0, int8 loads 2 l0 and 2 l0 + 1), a chunk of up to 8 steps
// unrolled at a time. int4 sums a chunk in int16 lanes that start at the chunk's correction word
// (xc: -8 sum(x) per half of a lane pair), so one vpmaddwd gives the exact sum((u - 8) x) of the
// chunk (each lane's true total fits int16; vpaddw wraps, so partial sums may not): the group
// sums are exact integers, as quant_tile's, and meet the scales in the same FMA.
// v as an opaque register: keeps GCC from reassociating a chain of integer adds into a tree of
// independent products, which unrolled needs more registers than there are (every one spilled).
inline __m256i opaque(__m256i v) {
  __asm__("" : "+x"(v));
  return v;
}

template <int R, int BITS, int CS>
inline void rows_chunk(const uint8_t* wst, int l0, const int8_t* x, int64_t k, const int32_t* xc, int64_t xc_stride,
                       __m256i* s) {
  const __m256i ones = _mm256_set1_epi16(1);
  if constexpr (BITS == 4) {
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    __m256i h[2 * R];
    KV_UNROLL for (int i = 0; i < R; ++i) h[2 * i] = h[2 * i + 1] = _mm256_set1_epi32(xc[i * xc_stride]);
    KV_UNROLL for (int st = 0; st < CS; ++st) {
      const __m256i a = _mm256_loadu_si256((const __m256i*)(wst + st * 128 + 32 * l0));
      const __m256i lo = _mm256_and_si256(a, low4), hi = _mm256_and_si256(_mm256_srli_epi16(a, 4), low4);
      KV_UNROLL for (int i = 0; i < R; ++i) {
        const __m256i xb = bcast4(x + i * k + 4 * st);
        h[2 * i] = opaque(_mm256_add_epi16(h[2 * i], _mm256_maddubs_epi16(lo, xb)));
        h[2 * i + 1] = opaque(_mm256_add_epi16(h[2 * i + 1], _mm256_maddubs_epi16(hi, xb)));
      }
    }
    KV_UNROLL for (int j = 0; j < 2 * R; ++j) s[j] = _mm256_add_epi32(s[j], _mm256_madd_epi16(h[j], ones));
  } else {
    const __m256i flip = _mm256_set1_epi8((char)0x80);
    KV_UNROLL for (int st = 0; st < CS; ++st) {
      __m256i q[2], aq[2];
      KV_UNROLL for (int j = 0; j < 2; ++j) {
        q[j] = _mm256_xor_si256(_mm256_loadu_si256((const __m256i*)(wst + st * 256 + 64 * l0 + 32 * j)), flip);
        aq[j] = _mm256_abs_epi8(q[j]);
      }
      KV_UNROLL for (int i = 0; i < R; ++i) {
        const __m256i xb = bcast4(x + i * k + 4 * st);
        KV_UNROLL for (int j = 0; j < 2; ++j)
          s[2 * i + j] = opaque(_mm256_add_epi32(
              s[2 * i + j], _mm256_madd_epi16(_mm256_maddubs_epi16(aq[j], _mm256_sign_epi8(xb, q[j])), ones)));
      }
    }
  }
}

template <int R, int BITS>
void quant_tile_rows(const int8_t* xq, int64_t k, const float* xd, const int32_t* xc, int64_t groups,
                     const uint8_t* w, const uint16_t* ws, int64_t group, const float* bias, void* y, bool y_bf16,
                     int64_t ldy, int64_t col0, int64_t n, int l0) {
  constexpr int64_t kStepBytes = BITS == 8 ? 256 : 128;
  const int vec[2] = {BITS == 8 ? 2 * l0 : 4 * (l0 / 2) + l0 % 2, BITS == 8 ? 2 * l0 + 1 : 4 * (l0 / 2) + 2 + l0 % 2};
  const int64_t steps = group / 4, cpg = (group + 31) / 32, xc_stride = groups * cpg;
  alignas(32) float acc[2 * R][8] = {};  // [row][slice vector]: in memory, the registers hold the sums
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* wg = w + g * steps * kStepBytes;
    const int8_t* xg = xq + g * group;
    const int32_t* xcg = BITS == 4 ? xc + g * cpg : nullptr;
    __m256i s[2 * R];
    KV_UNROLL for (int j = 0; j < 2 * R; ++j) s[j] = _mm256_setzero_si256();
    int64_t st = 0;
    for (; st + 8 <= steps; st += 8)
      rows_chunk<R, BITS, 8>(wg + st * kStepBytes, l0, xg + 4 * st, k, BITS == 4 ? xcg + st / 8 : nullptr, xc_stride, s);
    if (st < steps)  // group % 32 == 16: a last chunk of 4 steps
      rows_chunk<R, BITS, 4>(wg + st * kStepBytes, l0, xg + 4 * st, k, BITS == 4 ? xcg + st / 8 : nullptr, xc_stride, s);
    const __m256 ws0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(ws + g * 64 + 8 * vec[0])));
    const __m256 ws1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(ws + g * 64 + 8 * vec[1])));
    KV_UNROLL for (int i = 0; i < R; ++i) {
      const __m256 dx = _mm256_set1_ps(xd[i * groups + g]);
      _mm256_store_ps(acc[2 * i], _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[2 * i]), _mm256_mul_ps(ws0, dx),
                                                  _mm256_load_ps(acc[2 * i])));
      _mm256_store_ps(acc[2 * i + 1], _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[2 * i + 1]), _mm256_mul_ps(ws1, dx),
                                                      _mm256_load_ps(acc[2 * i + 1])));
    }
  }
  for (int j = 0; j < 2; ++j) {
    const int64_t col = col0 + 8 * vec[j], width = std::min<int64_t>(8, n - col);
    if (width <= 0) continue;
    alignas(32) float b[8] = {};
    if (bias) std::memcpy(b, bias + col, width * sizeof(float));
    for (int i = 0; i < R; ++i)
      store8(_mm256_add_ps(_mm256_load_ps(acc[2 * i + j]), _mm256_load_ps(b)), y, y_bf16, i * ldy + col, width);
  }
}

using QuantTileFn = decltype(&quant_tile<1, 8, 1, false, false>);

// The tile for mr rows of a 64-column block, and how many of a step's 32-byte loads it covers:
// one row takes them all (a sequential stream), more rows fewer at a time so that their sums fit
// the registers.
template <int BITS, bool PREFETCH>
QuantTileFn quant_tile_for(int mr, int* loads) {
  constexpr int kFull = BITS == 8 ? 8 : 4, kHalf = kFull / 2, kQuarter = kFull / 4;
  *loads = mr == 1 ? kFull : mr == 2 ? kHalf : kQuarter;
  switch (mr) {
    case 1: return quant_tile<1, BITS, kFull, false, PREFETCH>;
    case 2: return quant_tile<2, BITS, kHalf, false, PREFETCH>;
    case 3: return quant_tile<3, BITS, kQuarter, BITS == 8, PREFETCH>;
    default: return quant_tile<4, BITS, kQuarter, BITS == 8, PREFETCH>;
  }
}

QuantTileFn pick_quant_tile(int64_t bits, bool prefetch, int mr, int* loads) {
  if (bits == 8) return prefetch ? quant_tile_for<8, true>(mr, loads) : quant_tile_for<8, false>(mr, loads);
  return prefetch ? quant_tile_for<4, true>(mr, loads) : quant_tile_for<4, false>(mr, loads);
}

}  // namespace

void quant_linear(const void* x, bool x_bf16, int64_t ldx, int64_t m, int64_t k, const uint8_t* wp,
                  const uint16_t* sp, int64_t bits, int64_t group, const float* bias, void* y, int64_t n,
                  int64_t col_blocks) {
  if (m <= 0) return;
  const int64_t groups = k / group, chunks = chunks_per_row(k, group);
  const bool rows_tile = m >= kRowsTileM;  // int4's chunk corrections only for the many-row tile
  // The activations, quantized once for all column blocks, into this calling thread's scratch
  // (kept between calls: an allocation per call costs as much as a small matrix's work at batch 1).
  thread_local std::vector<int32_t> scratch;
  const int64_t q_words = (m * k + 3) / 4, c_words = rows_tile && bits == 4 ? m * chunks : 0;
  scratch.resize(std::max<size_t>(scratch.size(), q_words + 2 * m * groups + c_words));
  int8_t* xq = reinterpret_cast<int8_t*>(scratch.data());
  float* xd = reinterpret_cast<float*>(scratch.data() + q_words);
  int32_t* xs = scratch.data() + q_words + m * groups;
  int32_t* xc = c_words ? xs + m * groups : nullptr;
  if (x_bf16)
    quantize_rows(static_cast<const uint16_t*>(x), ldx, m, k, group, xq, xd, xs, xc);
  else
    quantize_rows(static_cast<const float*>(x), ldx, m, k, group, xq, xd, xs, xc);
  char* yp = static_cast<char*>(y);
  const int64_t y_item = x_bf16 ? 2 : 4, step_bytes = bits == 8 ? 256 : 128, block_loads = step_bytes / 32;
  const QuantTileFn rows_fn = bits == 8 ? quant_tile_rows<kRowsTileM, 8> : quant_tile_rows<kRowsTileM, 4>;
  // Work items (block of rows, 64-column block), as in linear_bf16. A matrix with few column
  // blocks is not cut into half blocks: two threads reading alternate cache lines of one block
  // each pull both lines in (the adjacent-line prefetch), which costs more than the imbalance.
  const int64_t col_items = col_blocks;
  const int64_t rows_per_item = linear_rows_per_item(m, col_items, kQuantTileM, kQuantBlockM);
  const int64_t row_items = (m + rows_per_item - 1) / rows_per_item;
  parallel_items(row_items * col_items, [&](ItemQueue& queue) {
    for (int64_t item; queue.next(&item);) {
      const int64_t r0 = (item % row_items) * rows_per_item, cb = item / row_items;
      const int64_t r1 = std::min(m, r0 + rows_per_item), full = rows_tile ? r0 + (r1 - r0) / kRowsTileM * kRowsTileM : r0;
      const uint8_t* w = wp + cb * (k / 4) * step_bytes;
      const uint16_t* ws = sp + cb * groups * 64;
      for (int l = 0; l < 4 && full > r0; ++l)  // 16-column slices, each over the item's row tiles
        for (int64_t r = r0; r < full; r += kRowsTileM)
          rows_fn(xq + r * k, k, xd + r * groups, xc ? xc + r * chunks : nullptr, groups, w, ws, group, bias,
                  yp + r * n * y_item, x_bf16, n, cb * 64, n, l);
      for (int64_t r = full; r < r1; r += kQuantTileM) {
        const int mr = (int)std::min<int64_t>(kQuantTileM, r1 - r);
        for (int64_t l = 0; l < block_loads;) {
          int loads;  // the item's first tile brings its weights in
          const QuantTileFn fn = pick_quant_tile(bits, r == r0 && l == 0, mr, &loads);
          fn(xq + r * k, k, xd + r * groups, xs + r * groups, groups, w, ws, group, bias, yp + r * n * y_item,
             x_bf16, n, cb * 64, n, (int)l);
          l += loads;
        }
      }
    }
  });
}

}  // namespace kvserve::avx2
