// kvserve::linear_bf16: the bf16 linear on pre-packed weights (see ops.cpp).
#pragma once

#include "common.h"
#include "linear_amx.h"

namespace kvserve {

// ---- linear: y[M, N] = x[M, K] @ W[N, K].T (+ bias) ------------------------------
// Packed layout (built by models/cpu_ops.py): wp[N / 64][K / 2][64][2], i.e. for each
// block of 64 output columns, each pair of input features holds the 64 columns' two
// weights side by side: a 64-byte load feeds one vdpbf16ps (16 columns) with a
// broadcast x pair, and a tile reads its weights as one sequential stream.

constexpr int kTileM = 6;       // rows of x per register tile
constexpr int kTileN = 4;       // 16-column groups per register tile = one 64-column block
constexpr int64_t kBlockM = 96;   // rows per work item: their slice of x stays in L2

// One MR x 64 tile over all input features, then the bias, written as bf16 to y. The
// tile streams its column block's weights from L2 (the item's first tile brings them in);
// no K blocking: splitting K to keep weights in L1 cost more in partial-sum traffic than
// it saved (benchmarks/bench_kernels.py).
template <int MR>
KV_AVX512_BF16 void linear_tile(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t half_k,
                                const float* bias, uint16_t* y, int64_t ldy, int64_t col0, int64_t n) {
  constexpr int NR = kTileN;
  __m512 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t kh = 0; kh < half_k; ++kh) {
    __m512bh wv[NR];
    for (int j = 0; j < NR; ++j) wv[j] = (__m512bh)_mm512_loadu_si512(w + kh * 128 + j * 32);
    for (int i = 0; i < MR; ++i) {
      int32_t pair;
      std::memcpy(&pair, x + i * ldx + 2 * kh, sizeof(pair));
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, wv[j]);
    }
  }
  for (int j = 0; j < NR; ++j) {
    const int64_t col = col0 + 16 * j;
    const int64_t width = std::min<int64_t>(16, n - col);
    if (width <= 0) break;
    const __mmask16 mask = width == 16 ? 0xFFFF : (__mmask16)((1u << width) - 1);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + col) : _mm512_setzero_ps();
    for (int i = 0; i < MR; ++i) {
      const __m256i out = (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc[i][j], b));
      _mm256_mask_storeu_epi16(y + i * ldy + col, mask, out);
    }
  }
}

using TileFn = decltype(&linear_tile<1>);

TileFn tile_fn(int mr) {
  switch (mr) {
    case 1: return linear_tile<1>;
    case 2: return linear_tile<2>;
    case 3: return linear_tile<3>;
    case 4: return linear_tile<4>;
    case 5: return linear_tile<5>;
    default: return linear_tile<6>;
  }
}

at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                       int64_t n) {
  TORCH_CHECK(has_avx512_bf16(), "linear_bf16 needs a CPU with AVX512-BF16");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.stride(1) == 1, "x must be [M, K] bf16 rows");
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == 64 && packed.size(3) == 2 && packed.is_contiguous() &&
                  packed.scalar_type() == at::kBFloat16,
              "packed weight must be bf16 [N/64, K/2, 64, 2]");
  const int64_t m = x.size(0), half_k = packed.size(1), col_blocks = packed.size(0);
  TORCH_CHECK(x.size(1) == 2 * half_k, "x has ", x.size(1), " features, the weight ", 2 * half_k);
  TORCH_CHECK(n <= 64 * col_blocks && n > 64 * (col_blocks - 1), "n=", n, " does not match the packed weight");
  const float* bias_ptr = linear_bias(bias, n);
  at::Tensor y = at::empty({m, n}, x.options());
  if (m == 0) return y;
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const auto* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  const int64_t ldx = x.stride(0);
  if (m >= kAmxMinRows && half_k % 16 == 0 && use_amx()) {
    linear_amx(xp, ldx, m, wp, half_k, col_blocks, bias_ptr, yp, n);
    return y;
  }
  // Work items: (block of rows, 64-column block).
  const int64_t rows_per_item = linear_rows_per_item(m, col_blocks, kTileM, kBlockM);
  const int64_t row_items = (m + rows_per_item - 1) / rows_per_item;
  // Row blocks vary fastest, so each thread's contiguous share mixes full and short row
  // blocks when a few column blocks are split by rows.
  at::parallel_for(0, row_items * col_blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t r0 = (item % row_items) * rows_per_item, cb = item / row_items;
      const int64_t r1 = std::min(m, r0 + rows_per_item);
      const uint16_t* w = wp + cb * half_k * 128;
      for (int64_t r = r0; r < r1; r += kTileM) {
        const int mr = (int)std::min<int64_t>(kTileM, r1 - r);
        tile_fn(mr)(xp + r * ldx, ldx, w, half_k, bias_ptr, yp + r * n, n, cb * 64, n);
      }
    }
  });
  return y;
}

}  // namespace kvserve
