// The bf16 linear on pre-packed weights: 4 x 16 register tiles of fp32 FMAs.
#include "neon.h"

namespace kvserve::neon {

// ---- linear: y[M, N] = x[M, K] @ W[N, K].T (+ bias) ------------------------------
// Packed layout (built by models/cpu_ops.py): wp[N / 64][K / 2][64][2], i.e. for each block of
// 64 output columns, each pair of input features holds the 64 columns' two weights side by
// side. A 16-byte load is 4 columns' pairs: shifting each 32-bit lane left by 16 widens the
// even feature's weights to fp32, masking off the low half the odd one's; each then meets
// its x value by a lane-indexed FMA.

constexpr int kTileM = 4;        // rows of x per register tile: 16 accumulators, 4 x vectors
constexpr int kTileV = 4;        // 4-column vectors per tile: 16 of the block's 64 columns
constexpr int64_t kBlockM = 64;  // rows per work item

// acc[i][j] += xv[i][0] * w_even[j] + xv[i][1] * w_odd[j]: one feature pair (its weights at wk,
// its two x values in lanes 0 and 1 of each row's vector).
template <int MR>
inline void pair_step(float32x4_t (&acc)[MR][kTileV], const float32x4_t (&xv)[MR], const uint32_t* wk) {
  const uint32x4_t odd_mask = vdupq_n_u32(0xFFFF0000u);
  for (int j = 0; j < kTileV; ++j) {
    const uint32x4_t raw = vld1q_u32(wk + 4 * j);
    const float32x4_t we = vreinterpretq_f32_u32(vshlq_n_u32(raw, 16));
    const float32x4_t wo = vreinterpretq_f32_u32(vandq_u32(raw, odd_mask));
    for (int i = 0; i < MR; ++i) {
      acc[i][j] = vfmaq_laneq_f32(acc[i][j], we, xv[i], 0);
      acc[i][j] = vfmaq_laneq_f32(acc[i][j], wo, xv[i], 1);
    }
  }
}

// One MR x 16 tile (columns col .. col + 15; w points at their weights in the first pair)
// over all input features, then the bias, written as bf16 to y. Each row's sums run in the
// same order whatever MR, so a row's bits do not depend on the batch around it.
template <int MR>
void linear_tile(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t half_k, const float* bias, uint16_t* y,
                 int64_t ldy, int64_t col, int64_t n) {
  float32x4_t acc[MR][kTileV];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < kTileV; ++j) acc[i][j] = vdupq_n_f32(0.f);
  const uint32_t* wp = reinterpret_cast<const uint32_t*>(w);  // one pair per 32-bit lane, 64 per step
  // One pair a step (unrolling two pairs made the compiler spill the second pair's weights).
  // x is read 4 wide while another pair follows, 2 wide for the last one (the row may end there).
  int64_t kh = 0;
  for (; kh + 1 < half_k; ++kh) {
    float32x4_t xv[MR];
    for (int i = 0; i < MR; ++i) xv[i] = load_bf16(x + i * ldx + 2 * kh);
    pair_step<MR>(acc, xv, wp + kh * 64);
  }
  if (kh < half_k) {
    float32x4_t xv[MR];
    for (int i = 0; i < MR; ++i) xv[i] = load_bf16_partial(x + i * ldx + 2 * kh, 2);
    pair_step<MR>(acc, xv, wp + kh * 64);
  }
  for (int j = 0; j < kTileV; ++j) {
    const int64_t c = col + 4 * j, width = std::min<int64_t>(4, n - c);
    if (width <= 0) break;
    const float32x4_t b = !bias ? vdupq_n_f32(0.f) : width == 4 ? vld1q_f32(bias + c) : load_f32_partial(bias + c, width, 0.f);
    for (int i = 0; i < MR; ++i) {
      const float32x4_t out = vaddq_f32(acc[i][j], b);
      if (width == 4) store_bf16(y + i * ldy + c, out);
      else store_bf16_partial(y + i * ldy + c, out, width);
    }
  }
}

using TileFn = decltype(&linear_tile<1>);

inline TileFn tile_fn(int mr) {
  switch (mr) {
    case 1: return linear_tile<1>;
    case 2: return linear_tile<2>;
    case 3: return linear_tile<3>;
    default: return linear_tile<4>;
  }
}

void linear_bf16(const uint16_t* xp, int64_t ldx, int64_t m, const uint16_t* wp, int64_t half_k, int64_t col_blocks,
                 const float* bias, uint16_t* yp, int64_t n) {
  // Work items: (block of rows, 64-column block), row blocks varying fastest (as the AVX-512 set).
  const int64_t rows_per_item = linear_rows_per_item(m, col_blocks, kTileM, kBlockM);
  const int64_t row_items = (m + rows_per_item - 1) / rows_per_item;
  parallel_for(0, row_items * col_blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t r0 = (item % row_items) * rows_per_item, cb = item / row_items;
      const int64_t r1 = std::min(m, r0 + rows_per_item);
      const uint16_t* w = wp + cb * half_k * 128;
      // 16 columns at a time over the item's rows: their weights stay cached across row tiles
      for (int64_t c = 0; c < 64 && cb * 64 + c < n; c += 16)
        for (int64_t r = r0; r < r1; r += kTileM) {
          const int mr = (int)std::min<int64_t>(kTileM, r1 - r);
          tile_fn(mr)(xp + r * ldx, ldx, w + 2 * c, half_k, bias, yp + r * n, n, cb * 64 + c, n);
        }
    }
  });
}

}  // namespace kvserve::neon
