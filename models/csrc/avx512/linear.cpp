// The bf16 linear on pre-packed weights: 6x64 register tiles of vdpbf16ps, and AMX tiles from
// a few rows on where the CPU has them; without BF16 (the avx512vnni build) the same tiles in
// fp32 FMAs, the weights widened in registers.
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>

#include "avx512.h"

namespace kvserve::avx512 {

#ifdef __AMX_BF16__
// True when the CPU has AMX-BF16 and Linux lets this process use the tile registers (their
// state is opt-in per process: arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)).
inline bool has_amx_bf16() {
  static const bool ok = [] {
    if (!__builtin_cpu_supports("amx-tile") || !__builtin_cpu_supports("amx-bf16"))
      return false;
    constexpr long kReqXcompPerm = 0x1023, kXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtiledata) == 0;
  }();
  return ok;
}

// The tile path can be turned off (models/cpu_ops.py: KVSERVE_CPU_AMX=0): its fp32 sums are not
// the AVX512 path's bit for bit, so with it a row's result depends on whether its step multiplies
// 8 rows or more; without it every row's bits are the same at any batch size.
inline std::atomic<bool>& amx_enabled() {
  static std::atomic<bool> enabled{true};
  return enabled;
}

inline bool use_amx() { return has_amx_bf16() && amx_enabled().load(std::memory_order_relaxed); }

// Rows from which the tiles win over linear_bf16's AVX512 path (fewer rows: the weights'
// stream bounds both, and the tile path pads to 32 rows).
constexpr int64_t kAmxMinRows = 8;

// Palette 1: tiles 0-3 accumulate a 32 x 32 fp32 block of y (2 x 2 tiles of 16 x 16), 4-5
// hold 2 x 16 rows of x (32 input features each), 6-7 the weights of 2 x 16 columns (16
// feature pairs each: exactly a 16-row slice of the packed layout, rows 256 bytes apart).
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
  TileConfig() {
    for (int t = 0; t < 8; ++t) colsb[t] = 64, rows[t] = 16;
  }
};

// y rows [r, r + 32) x columns [col0, col0 + 32) of one 64-column block `w` ([K/2][64][2]),
// x rows from `xr` (ldx apart, 32 of them readable), fp32 result into c [32][32].
KV_AMX inline void amx_block(const uint16_t* xr, int64_t ldx, const uint16_t* w, int64_t half_k, int64_t col0,
                             float* c) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  const int64_t x_stride = ldx * 2;
  for (int64_t kh = 0; kh < half_k; kh += 16) {
    const uint16_t* b = w + kh * 128 + col0 * 2;
    _tile_loadd(4, xr + 2 * kh, x_stride);
    _tile_loadd(5, xr + 16 * ldx + 2 * kh, x_stride);
    _tile_loadd(6, b, 256);
    _tile_loadd(7, b + 32, 256);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, c, 128);
  _tile_stored(1, c + 16, 128);
  _tile_stored(2, c + 16 * 32, 128);
  _tile_stored(3, c + 16 * 32 + 16, 128);
}

// c [32][32] (+ bias) -> y rows [0, rows) of columns [col, col + 32) as bf16, masked to n.
KV_AMX inline void amx_store(const float* c, int64_t rows, const float* bias, uint16_t* y, int64_t ldy, int64_t col,
                             int64_t n) {
  for (int h = 0; h < 2; ++h) {
    const int64_t c0 = col + 16 * h, width = std::min<int64_t>(16, n - c0);
    if (width <= 0) break;
    const __mmask16 mask = width == 16 ? 0xFFFF : (__mmask16)((1u << width) - 1);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + c0) : _mm512_setzero_ps();
    for (int64_t i = 0; i < rows; ++i) {
      const __m512 v = _mm512_add_ps(_mm512_loadu_ps(c + i * 32 + 16 * h), b);
      _mm256_mask_storeu_epi16(y + i * ldy + c0, mask, to_bf16(v));
    }
  }
}

struct AmxLinear {
  const uint16_t* xp;
  int64_t ldx, m;
  const uint16_t* wp;
  int64_t half_k;
  const float* bias;
  uint16_t* yp;
  int64_t n, rows_per_item, row_items;
};

// Work items [begin, end) of `a`: (row block, 64-column block), row blocks in multiples of 32;
// the last rows of x, when fewer than 32, are read from a zero-padded copy. (A function of its
// own: the lambda of parallel_for does not take the AMX target attribute.)
KV_AMX inline void linear_amx_items(const AmxLinear& a, int64_t begin, int64_t end) {
  TileConfig cfg;
  _tile_loadconfig(&cfg);
  alignas(64) float c[32 * 32];
  const int64_t full_rows = a.m / 32 * 32;
  std::vector<uint16_t> tail;  // the last rows, zero-padded to 32
  for (int64_t item = begin; item < end; ++item) {
    const int64_t r0 = (item % a.row_items) * a.rows_per_item, cb = item / a.row_items;
    const int64_t r1 = std::min(a.m, r0 + a.rows_per_item);
    const uint16_t* w = a.wp + cb * a.half_k * 128;
    for (int64_t r = r0; r < r1; r += 32) {
      const uint16_t* xr = a.xp + r * a.ldx;
      int64_t x_ld = a.ldx;
      if (r >= full_rows) {
        if (tail.empty()) {
          tail.assign(32 * 2 * a.half_k, 0);
          for (int64_t i = 0; i < a.m - full_rows; ++i)
            std::memcpy(tail.data() + i * 2 * a.half_k, a.xp + (full_rows + i) * a.ldx, 4 * a.half_k);
        }
        xr = tail.data(), x_ld = 2 * a.half_k;
      }
      for (int64_t col = 0; col < 64 && cb * 64 + col < a.n; col += 32) {
        amx_block(xr, x_ld, w, a.half_k, col, c);
        amx_store(c, std::min<int64_t>(32, r1 - r), a.bias, a.yp + r * a.n, a.n, cb * 64 + col, a.n);
      }
    }
  }
  _tile_release();
}

// y[M, N] = x[M, K] @ W.T (+ bias), W packed as for linear_bf16; K a multiple of 32.
inline void linear_amx(const uint16_t* xp, int64_t ldx, int64_t m, const uint16_t* wp, int64_t half_k,
                       int64_t col_blocks, const float* bias, uint16_t* yp, int64_t n) {
  const int64_t rows_per_item = linear_rows_per_item(m, col_blocks, 32, 128);
  const AmxLinear a{xp, ldx, m, wp, half_k, bias, yp, n, rows_per_item, (m + rows_per_item - 1) / rows_per_item};
  parallel_for(0, a.row_items * col_blocks, 1, [&](int64_t begin, int64_t end) { linear_amx_items(a, begin, end); });
}
#endif  // __AMX_BF16__

// ---- linear: y[M, N] = x[M, K] @ W[N, K].T (+ bias) ------------------------------
// Packed layout (built by models/cpu_ops.py): wp[N / 64][K / 2][64][2], i.e. for each
// block of 64 output columns, each pair of input features holds the 64 columns' two
// weights side by side: a 64-byte load feeds one vdpbf16ps (16 columns) with a
// broadcast x pair, and a tile reads its weights as one sequential stream.

constexpr int kTileM = 6;       // rows of x per register tile
constexpr int kTileN = 4;       // 16-column groups per register tile = one 64-column block
constexpr int64_t kBlockM = 96;   // rows per work item: their slice of x stays in L2

// acc (+ bias) -> MR rows of 16-column groups from col0, written as bf16 to y, masked to n.
template <int MR>
inline void store_tile(const __m512 (&acc)[MR][kTileN], const float* bias, uint16_t* y, int64_t ldy, int64_t col0,
                       int64_t n) {
  for (int j = 0; j < kTileN; ++j) {
    const int64_t col = col0 + 16 * j;
    const int64_t width = std::min<int64_t>(16, n - col);
    if (width <= 0) break;
    const __mmask16 mask = width == 16 ? 0xFFFF : (__mmask16)((1u << width) - 1);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + col) : _mm512_setzero_ps();
    for (int i = 0; i < MR; ++i) _mm256_mask_storeu_epi16(y + i * ldy + col, mask, to_bf16(_mm512_add_ps(acc[i][j], b)));
  }
}

// One row's tile streams its block's weights: fetch the lines of a step a few KiB ahead (where
// the hardware's prefetch alone lags: prefetch_streams()).
inline void stream_ahead(const uint16_t* step) {
  for (int line = 0; line < 4; ++line) _mm_prefetch((const char*)step + 4096 + 64 * line, _MM_HINT_T0);
}

// One MR x 64 tile over all input features, then the bias, written as bf16 to y. The
// tile streams its column block's weights from L2 (the item's first tile brings them in);
// no K blocking: splitting K to keep weights in L1 cost more in partial-sum traffic than
// it saved (benchmarks/bench_kernels.py).
#ifdef __AVX512BF16__
using XRow = uint16_t;  // x as given, bf16

template <int MR, bool PREFETCH = MR == 1>
KV_AVX512_BF16 void linear_tile(const XRow* x, int64_t ldx, const uint16_t* w, int64_t half_k, const float* bias,
                                uint16_t* y, int64_t ldy, int64_t col0, int64_t n) {
  constexpr int NR = kTileN;
  __m512 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t kh = 0; kh < half_k; ++kh) {
    if constexpr (PREFETCH) stream_ahead(w + kh * 128);
    __m512bh wv[NR];
    for (int j = 0; j < NR; ++j) wv[j] = (__m512bh)_mm512_loadu_si512(w + kh * 128 + j * 32);
    for (int i = 0; i < MR; ++i) {
      int32_t pair;
      std::memcpy(&pair, x + i * ldx + 2 * kh, sizeof(pair));
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, wv[j]);
    }
  }
  store_tile<MR>(acc, bias, y, ldy, col0, n);
}
#else
using XRow = float;  // x widened to fp32 once per call (widen_rows): a broadcast is then a load

// Each step adds a pair's odd then even products, in vdpbf16ps's order; a pair's odd weights
// are their lanes' high halves, the even ones shifted up.
template <int MR, bool PREFETCH = MR == 1>
void linear_tile(const XRow* x, int64_t ldx, const uint16_t* w, int64_t half_k, const float* bias, uint16_t* y,
                 int64_t ldy, int64_t col0, int64_t n) {
  constexpr int NR = kTileN;
  const __m512i high = _mm512_set1_epi32((int)0xFFFF0000u);
  __m512 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t kh = 0; kh < half_k; ++kh) {
    if constexpr (PREFETCH) stream_ahead(w + kh * 128);
    const uint16_t* wk = w + kh * 128;
    __m512 wv[NR];
    for (int j = 0; j < NR; ++j) wv[j] = _mm512_castsi512_ps(_mm512_and_si512(_mm512_loadu_si512(wk + 32 * j), high));
    for (int i = 0; i < MR; ++i) {
      const __m512 xv = _mm512_set1_ps(x[i * ldx + 2 * kh + 1]);
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_fmadd_ps(xv, wv[j], acc[i][j]);
    }
    for (int j = 0; j < NR; ++j) wv[j] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_loadu_si512(wk + 32 * j), 16));
    for (int i = 0; i < MR; ++i) {
      const __m512 xv = _mm512_set1_ps(x[i * ldx + 2 * kh]);
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_fmadd_ps(xv, wv[j], acc[i][j]);
    }
  }
  store_tile<MR>(acc, bias, y, ldy, col0, n);
}

// x [m, k] bf16 (ldx apart) -> out [m, k] fp32, exact.
inline void widen_rows(const uint16_t* x, int64_t ldx, int64_t m, int64_t k, float* out) {
  parallel_for(0, m, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const uint16_t* src = x + r * ldx;
      float* dst = out + r * k;
      int64_t i = 0;
      for (; i + 16 <= k; i += 16) _mm512_storeu_ps(dst + i, load_bf16_as_float(src + i));
      for (; i < k; ++i) {
        const uint32_t bits = (uint32_t)src[i] << 16;
        std::memcpy(dst + i, &bits, sizeof(bits));
      }
    }
  });
}
#endif

using TileFn = decltype(&linear_tile<1>);

TileFn tile_fn(int mr) {
  switch (mr) {
    case 1: return prefetch_streams() ? linear_tile<1> : linear_tile<1, false>;
    case 2: return linear_tile<2>;
    case 3: return linear_tile<3>;
    case 4: return linear_tile<4>;
    case 5: return linear_tile<5>;
    default: return linear_tile<6>;
  }
}

void linear_bf16(const uint16_t* xp, int64_t ldx, int64_t m, const uint16_t* wp, int64_t half_k, int64_t col_blocks,
                 const float* bias_ptr, uint16_t* yp, int64_t n) {
#ifdef __AMX_BF16__
  if (m >= kAmxMinRows && half_k % 16 == 0 && use_amx()) {
    linear_amx(xp, ldx, m, wp, half_k, col_blocks, bias_ptr, yp, n);
    return;
  }
#endif
#ifdef __AVX512BF16__
  const XRow* xs = xp;
  const int64_t lds = ldx;
#else
  // this calling thread's buffer, kept between calls (as quant_linear's scratch)
  thread_local std::vector<float> widened;
  widened.resize(std::max<size_t>(widened.size(), m * 2 * half_k));
  widen_rows(xp, ldx, m, 2 * half_k, widened.data());
  const XRow* xs = widened.data();
  const int64_t lds = 2 * half_k;
#endif
  // Work items: (block of rows, 64-column block), shared out at run time.
  const int64_t rows_per_item = linear_rows_per_item(m, col_blocks, kTileM, kBlockM);
  const int64_t row_items = (m + rows_per_item - 1) / rows_per_item;
  // Row blocks vary fastest, so each thread's contiguous share mixes full and short row
  // blocks when a few column blocks are split by rows.
  parallel_items(row_items * col_blocks, [&](ItemQueue& queue) {
    for (int64_t item; queue.next(&item);) {
      const int64_t r0 = (item % row_items) * rows_per_item, cb = item / row_items;
      const int64_t r1 = std::min(m, r0 + rows_per_item);
      const uint16_t* w = wp + cb * half_k * 128;
      for (int64_t r = r0; r < r1; r += kTileM) {
        const int mr = (int)std::min<int64_t>(kTileM, r1 - r);
        tile_fn(mr)(xs + r * lds, lds, w, half_k, bias_ptr, yp + r * n, n, cb * 64, n);
      }
    }
  });
}

#ifdef __AMX_BF16__
bool has_amx() { return has_amx_bf16(); }
bool set_amx(bool enabled) { return amx_enabled().exchange(enabled); }
#else
bool has_amx() { return false; }
bool set_amx(bool) { return false; }
#endif

}  // namespace kvserve::avx512
