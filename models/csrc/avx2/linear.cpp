// The bf16 linear on AVX2 + FMA: y[M, N] = x[M, K] @ W[N, K].T (+ bias) on pre-packed weights.
// Packed layout (models/cpu_ops.py): wp[N / 64][K / 2][64][2], per 64-column block each pair of
// input features holds the columns' two weights side by side. A 32-bit lane of a weight load is
// one column's (w[2kh], w[2kh + 1]): a shift widens the even one to fp32, a mask the odd one, and
// each meets a broadcast of x[2kh] or x[2kh + 1] in an FMA.
//
// x is widened to fp32 once per call (a scratch copy), so a broadcast is a plain load. Work items
// are (block of rows, 64-column block); an item walks K in chunks whose weights stay in L2 and
// keeps its fp32 sums in a scratch block between chunks. Every output element is accumulated in
// the same order (even then odd feature of each pair, pairs in order) whatever the tile shape or
// batch, so a row's result has the same bits alone or among others.
#include "avx2.h"

namespace kvserve::avx2 {
namespace {

constexpr int kTileM = 4;             // rows per register tile
constexpr int64_t kBlockM = 96;       // rows per work item
constexpr int64_t kChunkPairs = 256;  // feature pairs per K chunk: 64 KiB of a block's weights

// Rows [0, MR) x vectors [0, NV) (8 columns each) of c (fp32, rows ldc apart) += x[:, 2 kh0 ..]
// @ the weights `w` (already offset to the chunk and the first column) over `pairs` pairs.
// Registers: MR * NV accumulators, plus either every row's two broadcasts (ROWS_INNER: each
// weight vector widened once, used by all rows) or every vector's widened weights (rows outer).
template <int MR, int NV, bool ROWS_INNER>
void tile(const float* x, int64_t ldx, const uint16_t* w, int64_t pairs, float* c, int64_t ldc, bool first) {
  const __m256i odd_mask = _mm256_set1_epi32((int)0xFFFF0000u);
  __m256 acc[MR][NV];
  KV_UNROLL for (int i = 0; i < MR; ++i) {
    KV_UNROLL for (int j = 0; j < NV; ++j) {
      acc[i][j] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(c + i * ldc + 8 * j);
    }
  }
  for (int64_t kh = 0; kh < pairs; ++kh) {
    const uint16_t* wk = w + kh * 128;
    const float* xk = x + 2 * kh;
    if constexpr (MR == 1 && NV == 8) {  // one row streams the block: fetch a few KiB ahead
      KV_UNROLL for (int line = 0; line < 4; ++line) _mm_prefetch((const char*)wk + 4096 + 64 * line, _MM_HINT_T0);
    }
    __m256 even[NV], odd[NV];
    KV_UNROLL for (int j = 0; j < NV; ++j) {
      const __m256i v = _mm256_loadu_si256((const __m256i*)(wk + 16 * j));
      even[j] = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
      odd[j] = _mm256_castsi256_ps(_mm256_and_si256(v, odd_mask));
      if (ROWS_INNER) {
        KV_UNROLL for (int i = 0; i < MR; ++i) {
          acc[i][j] = _mm256_fmadd_ps(even[j], _mm256_broadcast_ss(xk + i * ldx), acc[i][j]);
          acc[i][j] = _mm256_fmadd_ps(odd[j], _mm256_broadcast_ss(xk + i * ldx + 1), acc[i][j]);
        }
      }
    }
    if (!ROWS_INNER) {
      KV_UNROLL for (int i = 0; i < MR; ++i) {
        const __m256 xe = _mm256_broadcast_ss(xk + i * ldx), xo = _mm256_broadcast_ss(xk + i * ldx + 1);
        KV_UNROLL for (int j = 0; j < NV; ++j) {
          acc[i][j] = _mm256_fmadd_ps(even[j], xe, acc[i][j]);
          acc[i][j] = _mm256_fmadd_ps(odd[j], xo, acc[i][j]);
        }
      }
    }
  }
  KV_UNROLL for (int i = 0; i < MR; ++i) {
    KV_UNROLL for (int j = 0; j < NV; ++j) _mm256_storeu_ps(c + i * ldc + 8 * j, acc[i][j]);
  }
}

// All 64 columns of mr rows: 1-2 rows take wide tiles (enough independent accumulators to hide
// the FMA latency), 3-4 rows 16 columns at a time.
template <int MR>
void row_tile(const float* x, int64_t ldx, const uint16_t* w, int64_t pairs, float* c, bool first) {
  constexpr int NV = MR == 1 ? 8 : MR == 2 ? 4 : 2;
  for (int v = 0; v < 8; v += NV) tile<MR, NV, (MR <= 2)>(x, ldx, w + 16 * v, pairs, c + 8 * v, 64, first);
}

using RowTileFn = decltype(&row_tile<1>);

RowTileFn row_tile_fn(int mr) {
  switch (mr) {
    case 1: return row_tile<1>;
    case 2: return row_tile<2>;
    case 3: return row_tile<3>;
    default: return row_tile<4>;
  }
}

// The same tile on weights already widened (`widen_chunk`): no integer work in the loop, so the
// FMA ports do nothing else; the same FMAs in the same order, so the same bits. Up to 6 rows x 16
// columns: 12 accumulators (enough independent FMAs in flight to cover their latency on both
// ports), the even features' two weight vectors, then the odd ones', and one broadcast at a time
// fit AVX2's 16 registers.
template <int MR>
void tile_wide(const float* x, int64_t ldx, const float* wf, int64_t pairs, float* c, int64_t ldc, bool first) {
  constexpr int NV = 2;
  __m256 acc[MR][NV];
  KV_UNROLL for (int i = 0; i < MR; ++i) {
    KV_UNROLL for (int j = 0; j < NV; ++j) {
      acc[i][j] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(c + i * ldc + 8 * j);
    }
  }
  for (int64_t kh = 0; kh < pairs; ++kh) {
    const float* wk = wf + kh * 32;
    const float* xk = x + 2 * kh;
    KV_UNROLL for (int half = 0; half < 2; ++half) {  // the even feature of the pair, then the odd one
      const __m256 w0 = _mm256_loadu_ps(wk + 16 * half), w1 = _mm256_loadu_ps(wk + 16 * half + 8);
      KV_UNROLL for (int i = 0; i < MR; ++i) {
        const __m256 xb = _mm256_broadcast_ss(xk + i * ldx + half);
        acc[i][0] = _mm256_fmadd_ps(w0, xb, acc[i][0]);
        acc[i][1] = _mm256_fmadd_ps(w1, xb, acc[i][1]);
      }
    }
  }
  KV_UNROLL for (int i = 0; i < MR; ++i) {
    KV_UNROLL for (int j = 0; j < NV; ++j) _mm256_storeu_ps(c + i * ldc + 8 * j, acc[i][j]);
  }
}

constexpr int kWideTileM = 6;  // rows per tile on widened weights

using TileWideFn = decltype(&tile_wide<1>);

TileWideFn tile_wide_fn(int mr) {
  switch (mr) {
    case 1: return tile_wide<1>;
    case 2: return tile_wide<2>;
    case 3: return tile_wide<3>;
    case 4: return tile_wide<4>;
    case 5: return tile_wide<5>;
    default: return tile_wide<6>;
  }
}

// One chunk of a block's packed weights ([pairs][64][2] bf16) -> fp32 strips of 16 columns,
// [4][pairs][even 16 | odd 16]: a strip (the weights of one column tile) is contiguous and small
// enough to stay in L1 while every row tile of the item reads it.
void widen_chunk(const uint16_t* w, int64_t pairs, float* out) {
  const __m256i odd_mask = _mm256_set1_epi32((int)0xFFFF0000u);
  for (int64_t kh = 0; kh < pairs; ++kh)
    for (int j = 0; j < 8; ++j) {
      const __m256i v = _mm256_loadu_si256((const __m256i*)(w + kh * 128 + 16 * j));
      float* dst = out + (j / 2) * pairs * 32 + kh * 32 + (j % 2) * 8;
      _mm256_storeu_ps(dst, _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)));
      _mm256_storeu_ps(dst + 16, _mm256_castsi256_ps(_mm256_and_si256(v, odd_mask)));
    }
}

// Rows of an item from which its weight chunks are widened once for all its row tiles.
constexpr int64_t kWidenMinRows = 8;

// c [rows][64] (+ bias) -> y columns [col0, col0 + 64) cut at n, rounded to bf16.
void finish(const float* c, int64_t rows, const float* bias, uint16_t* y, int64_t ldy, int64_t col0, int64_t n) {
  for (int64_t v = 0; v < 64; v += 8) {
    const int64_t col = col0 + v, width = std::min<int64_t>(8, n - col);
    if (width <= 0) break;
    __m256 b = _mm256_setzero_ps();
    if (bias) {
      if (width == 8) {
        b = _mm256_loadu_ps(bias + col);
      } else {
        alignas(32) float tmp[8] = {};
        std::memcpy(tmp, bias + col, width * sizeof(float));
        b = _mm256_load_ps(tmp);
      }
    }
    for (int64_t i = 0; i < rows; ++i) {
      const __m256 out = _mm256_add_ps(_mm256_loadu_ps(c + i * 64 + v), b);
      if (width == 8)
        store_bf16(y + i * ldy + col, out);
      else
        store_bf16_partial(y + i * ldy + col, out, width);
    }
  }
}

// x rows (bf16, ldx apart) -> fp32 rows k apart.
void widen_rows(const uint16_t* x, int64_t ldx, int64_t m, int64_t k, float* out) {
  parallel_for(0, m, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const uint16_t* src = x + r * ldx;
      float* dst = out + r * k;
      int64_t i = 0;
      for (; i + 8 <= k; i += 8) _mm256_storeu_ps(dst + i, load_bf16(src + i));
      for (; i < k; ++i) dst[i] = bf16_to_float(src[i]);
    }
  });
}

}  // namespace

void linear_bf16(const uint16_t* xp, int64_t ldx, int64_t m, const uint16_t* wp, int64_t half_k, int64_t col_blocks,
                 const float* bias, uint16_t* yp, int64_t n) {
  if (m <= 0) return;
  const int64_t k = 2 * half_k;
  thread_local std::vector<float> xf_scratch;  // kept between calls: no allocation per call
  if (xf_scratch.size() < (size_t)(m * k)) xf_scratch.resize(m * k);
  float* xf = xf_scratch.data();
  widen_rows(xp, ldx, m, k, xf);
  const int64_t rows_per_item = linear_rows_per_item(m, col_blocks, kTileM, kBlockM);
  const int64_t row_items = (m + rows_per_item - 1) / rows_per_item;
  // Row blocks vary fastest (as in the AVX-512 set): a thread's contiguous share mixes full and
  // short row blocks when a few column blocks are split by rows.
  parallel_items(row_items * col_blocks, [&](ItemQueue& queue) {
    thread_local std::vector<float> c_scratch, w_scratch;  // an item's fp32 sums; a widened chunk
    c_scratch.resize(kBlockM * 64);
    w_scratch.resize(kChunkPairs * 128);
    float* c = c_scratch.data();
    for (int64_t item; queue.next(&item);) {
      const int64_t r0 = (item % row_items) * rows_per_item, cb = item / row_items;
      const int64_t r1 = std::min(m, r0 + rows_per_item);
      const uint16_t* w = wp + cb * half_k * 128;
      if (half_k == 0) std::fill(c, c + (r1 - r0) * 64, 0.f);
      for (int64_t kh0 = 0; kh0 < half_k; kh0 += kChunkPairs) {
        const int64_t pairs = std::min(kChunkPairs, half_k - kh0);
        if (r1 - r0 >= kWidenMinRows) {  // each 16-column strip through every row tile
          widen_chunk(w + kh0 * 128, pairs, w_scratch.data());
          for (int v = 0; v < 4; ++v)
            for (int64_t r = r0; r < r1; r += kWideTileM) {
              const int mr = (int)std::min<int64_t>(kWideTileM, r1 - r);
              tile_wide_fn(mr)(xf + r * k + 2 * kh0, k, w_scratch.data() + v * pairs * 32, pairs,
                               c + (r - r0) * 64 + 16 * v, 64, kh0 == 0);
            }
          continue;
        }
        for (int64_t r = r0; r < r1; r += kTileM) {
          const int mr = (int)std::min<int64_t>(kTileM, r1 - r);
          row_tile_fn(mr)(xf + r * k + 2 * kh0, k, w + kh0 * 128, pairs, c + (r - r0) * 64, kh0 == 0);
        }
      }
      finish(c, r1 - r0, bias, yp + r0 * n, n, cb * 64, n);
    }
  });
}

}  // namespace kvserve::avx2
