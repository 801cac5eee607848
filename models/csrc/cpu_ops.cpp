// CPU kernels for the places where PyTorch's generic CPU ops leave most of the machine
// idle (measured in docs/benchmarks.md; `python -m loadtest.bench_kernels`):
//
//  * kvserve::linear_bf16    y = x @ W.T + b for bf16, with W pre-packed once into
//    64-column blocks of input-feature pairs. One 6x64 register tile of vdpbf16ps at any
//    batch: at batch 1 it streams the weights at close to DRAM bandwidth; at 64-2048 rows
//    it runs at 85-95% of this CPU's measured bf16 peak (oneDNN: 60-95%).
//  * kvserve::paged_decode_attention  one query token per request attending over its
//    keys/values *in place* in the paged cache (no gather copy), GQA-aware: the query
//    heads that share a KV head are scored together from one read of each key.
//  * kvserve::paged_prefill_attention  flash-style causal attention for a prompt chunk.
//  * kvserve::rms_norm, add_rms_norm_, rotary_, silu_and_mul, argmax_bf16  fused
//    per-layer ops with PyTorch's roundings; write_kv_cache stores a layer's new keys
//    and values.
//
// All accumulate in fp32. The AVX512-BF16 paths are compiled with target attributes
// and chosen at run time, so the library loads on any x86-64 CPU; the Python side
// (models/cpu_ops.py) only calls the linear and the two attention kernels (bf16 only)
// when `has_avx512_bf16()` is true. Elsewhere PyTorch's ops (oneDNN, SDPA) are faster
// than scalar C++ would be.
// Threads come from ATen's pool (at::parallel_for), the same one torch's ops use.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

#define KV_AVX512_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")))

bool has_avx512_bf16() {
  static const bool ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16");
  return ok;
}

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
// it saved (docs/benchmarks.md).
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
  const float* bias_ptr = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() >= n,
                "bias must be float32 [N]");
    bias_ptr = bias->data_ptr<float>();
  }
  at::Tensor y = at::empty({m, n}, x.options());
  if (m == 0) return y;
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const auto* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  const int64_t ldx = x.stride(0);
  // Work items: (block of rows, 64-column block).
  // With few column blocks, smaller row blocks keep every thread busy.
  const int64_t want_items = 8 * at::get_num_threads();
  int64_t rows_per_item = kBlockM;
  if (col_blocks < want_items) {
    const int64_t parts = (want_items + col_blocks - 1) / col_blocks;
    rows_per_item = std::clamp<int64_t>((m / parts + kTileM - 1) / kTileM * kTileM, kTileM, kBlockM);
  }
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

// ---- paged decode attention --------------------------------------------------------
// For request b and KV head h: the G = H / KvH query heads h*G .. h*G+G-1 attend over
// keys [start, seq_len) (start = seq_len - window with a sliding window, else 0), read
// through the block table. Two passes over the keys: scores (kept in a scratch row per
// query head), then softmax and the weighted sum of values.

struct DecodeArgs {
  int64_t num_kv_heads, group, head_dim, block_size;
  int64_t q_stride_req, q_stride_head;     // q[b, head, d] strides (d contiguous)
  int64_t cache_stride_block, cache_stride_token;  // within one K or V cache
  int64_t table_stride, window;
  float scale;
};

// Floats per score row in the bf16 kernel: a multiple of 32, so the row's bf16 probabilities
// (written over its first half) always have an even, zero-padded length.
inline int64_t decode_row_stride(int64_t len) { return (len + 31) / 32 * 32; }

// exp for x <= 0 (scores minus their max): Cephes' degree-6 polynomial after reducing by
// ln 2, scaled back with vscalefps; about 1 ulp, like the vectorized exp SDPA uses.
KV_AVX512_BF16 inline __m512 exp_nonpositive_unclamped(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
}

KV_AVX512_BF16 inline __m512 exp_nonpositive(__m512 x) {
  return exp_nonpositive_unclamped(_mm512_max_ps(x, _mm512_set1_ps(-104.f)));  // exp underflows to 0 before this
}

KV_AVX512_BF16 inline __m512 load_bf16_as_float(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}

// v[i] summed across its 16 lanes, for i = 0..15, as one vector (lane i = sum of v[i]):
// a transpose-and-add tree, 45 shuffles/adds instead of 16 horizontal reductions.
KV_AVX512_BF16 inline __m512 sum_each16(const __m512* v) {
  __m512 pairs[8], quads[4];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
    pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: that lane's sums of 4 vectors
    const __m512d x = _mm512_castps_pd(pairs[2 * i]), y = _mm512_castps_pd(pairs[2 * i + 1]);
    quads[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  const __m512 w01 = _mm512_add_ps(_mm512_shuffle_f32x4(quads[0], quads[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_f32x4(quads[0], quads[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 w23 = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2], quads[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_f32x4(quads[2], quads[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(w01, w23, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(w01, w23, _MM_SHUFFLE(3, 1, 3, 1)));
}

// q . k for up to 16 consecutive cached tokens (rows past n_tok are not read), one lane per
// token: 16 partial dot products, then one transposed reduction instead of 16 horizontal
// ones. N = 16 compiles the common full group with a fixed trip count (no branches, no
// spills); N = 0 takes n_tok at run time.
template <int CH, int N>
KV_AVX512_BF16 inline __m512 score_keys(const uint16_t* q, const uint16_t* const* keys, int64_t head_off, int n_tok) {
  const int n = N ? N : n_tok;
  __m512 part[16];
  for (int i = 0; i < 16; ++i) part[i] = _mm512_setzero_ps();
  for (int c = 0; c < CH / 2; ++c) {
    const __m512bh qv = (__m512bh)_mm512_loadu_si512(q + 32 * c);
    for (int i = 0; i < n; ++i)
      part[i] = _mm512_dpbf16_ps(part[i], qv, (__m512bh)_mm512_loadu_si512(keys[i] + head_off + 32 * c));
  }
  return sum_each16(part);
}

// Where cached tokens t0 .. t0 + n - 1 (all KV heads) sit in a K or V cache.
inline void token_rows(const uint16_t* cache, const int64_t* table, int64_t block_size, int64_t stride_block,
                       int64_t stride_token, int64_t t0, int n, const uint16_t** rows) {
  int64_t block = t0 / block_size, off = t0 % block_size;
  const uint16_t* base = cache + table[block] * stride_block;
  for (int i = 0; i < n; ++i) {
    rows[i] = base + off * stride_token;
    if (++off == block_size && i + 1 < n) {
      off = 0;
      base = cache + table[++block] * stride_block;
    }
  }
}

// Software prefetch of up to 16 token rows into L2, issued a few lines at a time between
// the compute that precedes their use. Cached blocks are scattered 2-6 KB runs that the
// hardware prefetchers barely follow: without this the cold kernel waited for DRAM and
// then computed (time = read + compute); spread like this the reads overlap the compute
// (about 1.7x faster at batch 64, docs/benchmarks.md). Bursts of prefetches did not help:
// they fill the miss buffers and stall the core just as the loads would.
struct RowPrefetcher {
  const char* rows[16];
  int n_rows = 0, lines_per_row = 0, row = 0, line = 0;

  void start(const uint16_t* const* token_rows, int n, int64_t head_off, int64_t row_bytes) {
    for (int i = 0; i < n; ++i) rows[i] = reinterpret_cast<const char*>(token_rows[i] + head_off);
    n_rows = n, lines_per_row = (int)((row_bytes + 63) / 64), row = 0, line = 0;
  }
  int lines_left() const { return (n_rows - row) * lines_per_row - line; }
  void issue(int count) {
    for (; count > 0 && row < n_rows; --count) {
      _mm_prefetch(rows[row] + 64 * line, _MM_HINT_T1);
      if (++line == lines_per_row) line = 0, ++row;
    }
  }
};

// One unit of decode work: a request's keys [start, end) for KV heads [h0, h1).
struct DecodeItem {
  const int64_t* table;  // the request's block-table row
  int64_t start, end, h0, h1;
};

// acc[g] += sum over the group's tokens of p[g][t] * v[t], for the g_n query rows sharing
// one KV head. Probabilities come as bf16 token pairs (p_pairs[g * p_stride + j] holds
// tokens 2j, 2j+1), values are interleaved into the same pairs, so one vdpbf16ps does two
// tokens x 16 dims. Accumulators keep the dims in unpacklo/unpackhi order (see
// store_pair_row); up to GB rows stay in registers for the whole group.
template <int CH, int N>
KV_AVX512_BF16 inline void accumulate_pairs(float* acc, int64_t g_n, const uint32_t* p_pairs, int64_t p_stride,
                                            const uint16_t* const* values, int64_t head_off, int n_tok) {
  const int n = N ? N : n_tok;
  constexpr int GB = CH >= 14 ? 1 : (28 - CH) / CH;
  for (int64_t g0 = 0; g0 < g_n; g0 += GB) {
    const int gn = (int)std::min<int64_t>(GB, g_n - g0);
    __m512 sum[GB][CH];
    for (int g = 0; g < GB; ++g)
      if (g < gn)
        for (int k = 0; k < CH; ++k) sum[g][k] = _mm512_loadu_ps(acc + (g0 + g) * CH * 16 + 16 * k);
    for (int j = 0; 2 * j < n; ++j) {
      const uint16_t* r0 = values[2 * j] + head_off;
      const uint16_t* r1 = (N || 2 * j + 1 < n) ? values[2 * j + 1] + head_off : nullptr;
      __m512i pairs[CH];
      for (int c = 0; c < CH / 2; ++c) {
        const __m512i x = _mm512_loadu_si512(r0 + 32 * c);
        const __m512i y = r1 ? _mm512_loadu_si512(r1 + 32 * c) : _mm512_setzero_si512();
        pairs[2 * c] = _mm512_unpacklo_epi16(x, y);
        pairs[2 * c + 1] = _mm512_unpackhi_epi16(x, y);
      }
      for (int g = 0; g < GB; ++g)
        if (g < gn) {
          const __m512bh p = (__m512bh)_mm512_set1_epi32((int)p_pairs[(g0 + g) * p_stride + j]);
          for (int k = 0; k < CH; ++k) sum[g][k] = _mm512_dpbf16_ps(sum[g][k], (__m512bh)pairs[k], p);
        }
    }
    for (int g = 0; g < GB; ++g)
      if (g < gn)
        for (int k = 0; k < CH; ++k) _mm512_storeu_ps(acc + (g0 + g) * CH * 16 + 16 * k, sum[g][k]);
  }
}

// One accumulated row (dims in unpack order: per 32-dim chunk, `lo` lane 4i+j is dim 8i+j
// and `hi` lane 4i+j is dim 8i+4+j) times inv, written as bf16 in natural order.
template <int CH>
KV_AVX512_BF16 inline void store_pair_row(const float* acc, float inv, uint16_t* out) {
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  const __m512 scale = _mm512_set1_ps(inv);
  for (int c = 0; c < CH / 2; ++c) {
    const __m512 lo = _mm512_loadu_ps(acc + 32 * c), hi = _mm512_loadu_ps(acc + 32 * c + 16);
    _mm256_storeu_si256((__m256i*)(out + 32 * c),
                        (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_permutex2var_ps(lo, first, hi), scale)));
    _mm256_storeu_si256((__m256i*)(out + 32 * c + 16),
                        (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_permutex2var_ps(lo, second, hi), scale)));
  }
}

// bf16, head_dim a multiple of 32 (<= 256): KV heads [h0, h1) of one request. Pass 1 scores every key (fp32, row r of `scores` at r * row_stride); the softmax
// then overwrites each row in place with its probabilities rounded to bf16 (as PyTorch's
// CPU SDPA does before its P @ V product; the denominator sums them unrounded, as there);
// pass 2 accumulates the values. acc: [(h1 - h0) * G][D]; q/out point at the request.
// CH = head_dim / 16 (even, <= 16), a template parameter so accumulators stay in registers.
template <int CH>
KV_AVX512_BF16 void attend_bf16(const DecodeArgs& a, const uint16_t* q, const uint16_t* kc, const uint16_t* vc,
                                const int64_t* table, int64_t start, int64_t end, int64_t h0, int64_t h1,
                                const DecodeItem* next, bool keys_prefetched, float* scores, float* acc,
                                uint16_t* out) {
  const int64_t len = end - start, g_n = a.group, d_n = a.head_dim;
  const int64_t rows = (h1 - h0) * g_n, row_stride = decode_row_stride(len);
  const __m512 scale = _mm512_set1_ps(a.scale);
  const uint16_t* tokens[16];
  const uint16_t* ahead[16];
  RowPrefetcher values_pf, keys_pf;
  auto prefetch = [&](RowPrefetcher& pf, const uint16_t* cache, const int64_t* tbl, int64_t t0, int64_t stop,
                      int64_t g_h0, int64_t g_h1) {
    const int n = (int)std::min<int64_t>(16, stop - t0);
    if (n <= 0) return void(pf.n_rows = 0);
    token_rows(cache, tbl, a.block_size, a.cache_stride_block, a.cache_stride_token, t0, n, ahead);
    pf.start(ahead, n, g_h0 * d_n, (g_h1 - g_h0) * d_n * 2);
  };
  // Pass 1, groups of 16 tokens from `start` (so bf16 pairs line up). Meanwhile: this
  // group's values (pass 2 reads them) and, unless the previous item fetched them, the
  // next group's keys.
  for (int64_t t0 = start; t0 < end; t0 += 16) {
    const int n_tok = (int)std::min<int64_t>(16, end - t0);
    const __mmask16 m = n_tok == 16 ? 0xFFFF : (__mmask16)((1u << n_tok) - 1);
    token_rows(kc, table, a.block_size, a.cache_stride_block, a.cache_stride_token, t0, n_tok, tokens);
    prefetch(values_pf, vc, table, t0, end, h0, h1);
    if (!keys_prefetched) prefetch(keys_pf, kc, table, t0 + 16, end, h0, h1);
    const int calls = (int)rows, per_call = (values_pf.lines_left() + keys_pf.lines_left() + calls - 1) / calls;
    for (int64_t h = h0; h < h1; ++h)
      for (int64_t g = 0; g < g_n; ++g) {
        values_pf.issue(per_call);
        keys_pf.issue(per_call);
        const uint16_t* qg = q + (h * g_n + g) * a.q_stride_head;
        const __m512 s = n_tok == 16 ? score_keys<CH, 16>(qg, tokens, h * d_n, 16)
                                     : score_keys<CH, 0>(qg, tokens, h * d_n, n_tok);
        _mm512_mask_storeu_ps(scores + ((h - h0) * g_n + g) * row_stride + (t0 - start), m, _mm512_mul_ps(s, scale));
      }
  }
  std::vector<float> denom(rows);
  for (int64_t r = 0; r < rows; ++r) {
    float* row = scores + r * row_stride;
    __m512 mx = _mm512_set1_ps(-INFINITY);
    for (int64_t i = 0; i < len; i += 16) {
      const __mmask16 m = len - i >= 16 ? 0xFFFF : (__mmask16)((1u << (len - i)) - 1);
      mx = _mm512_mask_max_ps(mx, m, mx, _mm512_maskz_loadu_ps(m, row + i));
    }
    const __m512 row_max = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
    __m512 sum = _mm512_setzero_ps();
    uint16_t* probs = reinterpret_cast<uint16_t*>(row);  // written behind the reads
    for (int64_t i = 0; i < len; i += 16) {  // zeros past len: the odd last token's partner
      const __mmask16 m = len - i >= 16 ? 0xFFFF : (__mmask16)((1u << (len - i)) - 1);
      const __m512 e = _mm512_maskz_mov_ps(m, exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, row + i), row_max)));
      _mm256_storeu_si256((__m256i*)(probs + i), (__m256i)_mm512_cvtneps_pbh(e));
      sum = _mm512_add_ps(sum, e);
    }
    denom[r] = _mm512_reduce_add_ps(sum);
  }
  std::fill(acc, acc + rows * d_n, 0.f);
  const uint32_t* pairs = reinterpret_cast<const uint32_t*>(scores);  // row r's pairs at r * row_stride
  // Pass 2; meanwhile the next item's keys at the same offset.
  for (int64_t t0 = start; t0 < end; t0 += 16) {
    const int n_tok = (int)std::min<int64_t>(16, end - t0);
    token_rows(vc, table, a.block_size, a.cache_stride_block, a.cache_stride_token, t0, n_tok, tokens);
    keys_pf.n_rows = 0;
    if (next) prefetch(keys_pf, kc, next->table, next->start + (t0 - start), next->end, next->h0, next->h1);
    const int per_call = (keys_pf.lines_left() + (int)(h1 - h0) - 1) / (int)(h1 - h0);
    for (int64_t h = h0; h < h1; ++h) {
      keys_pf.issue(per_call);
      const uint32_t* ph = pairs + (h - h0) * g_n * row_stride + (t0 - start) / 2;
      float* ah = acc + (h - h0) * g_n * d_n;
      if (n_tok == 16) accumulate_pairs<CH, 16>(ah, g_n, ph, row_stride, tokens, h * d_n, 16);
      else accumulate_pairs<CH, 0>(ah, g_n, ph, row_stride, tokens, h * d_n, n_tok);
    }
  }
  for (int64_t r = 0; r < rows; ++r) store_pair_row<CH>(acc + r * d_n, 1.f / denom[r], out + (h0 * g_n + r) * d_n);
}

// The instantiation of a kernel templated on CH = head_dim / 16 (even, 2..16) for head_dim.
template <typename Fn, template <int> class Kernel>
Fn for_head_dim(int64_t head_dim) {
  switch (head_dim / 16) {
    case 2: return Kernel<2>::run;
    case 4: return Kernel<4>::run;
    case 6: return Kernel<6>::run;
    case 8: return Kernel<8>::run;
    case 10: return Kernel<10>::run;
    case 12: return Kernel<12>::run;
    case 14: return Kernel<14>::run;
    default: return Kernel<16>::run;
  }
}

template <int CH>
struct AttendBf16 {
  static constexpr auto run = attend_bf16<CH>;
};
using AttendFn = decltype(&attend_bf16<2>);

void decode_attention_bf16(const DecodeArgs& a, const uint16_t* q, const uint16_t* kc, const uint16_t* vc,
                           const int64_t* table, const int64_t* seq_lens, int64_t num_reqs, uint16_t* out) {
  // Enough requests to share out: one work item per request (all its KV heads, reading
  // each cached token's heads together); otherwise one per (request, KV head).
  const int64_t heads_per_item = a.num_kv_heads > 1 && num_reqs < 2 * at::get_num_threads() ? 1 : a.num_kv_heads;
  const int64_t items_per_req = a.num_kv_heads / heads_per_item;
  auto item_at = [&](int64_t item) {
    const int64_t b = item / items_per_req, h0 = item % items_per_req * heads_per_item, seq_len = seq_lens[b];
    const int64_t start = a.window > 0 ? std::max<int64_t>(0, seq_len - a.window) : 0;
    return DecodeItem{table + b * a.table_stride, start, seq_len, h0, h0 + heads_per_item};
  };
  const AttendFn attend = for_head_dim<AttendFn, AttendBf16>(a.head_dim);
  at::parallel_for(0, num_reqs * items_per_req, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, acc(heads_per_item * a.group * a.head_dim);
    for (int64_t item = begin; item < end; ++item) {
      const DecodeItem it = item_at(item);
      const int64_t b = item / items_per_req;
      scores.resize(std::max<int64_t>(1, heads_per_item * a.group * decode_row_stride(it.end - it.start)));
      // the item after this one in this thread's range: its keys are fetched during our pass 2
      const DecodeItem next = item + 1 < end ? item_at(item + 1) : DecodeItem{};
      attend(a, q + b * a.q_stride_req, kc, vc, it.table, it.start, it.end, it.h0, it.h1,
             item + 1 < end ? &next : nullptr, item > begin, scores.data(), acc.data(),
             out + b * a.num_kv_heads * a.group * a.head_dim);
    }
  });
}

// q [B, H, D] (d contiguous), k_cache/v_cache [num_blocks, block_size, KvH, D],
// block_table [B, max_blocks] int64, seq_lens [B] int64 (>= 1) -> out [B, H * D].
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_table, const at::Tensor& seq_lens, double scale,
                                  int64_t window) {
  TORCH_CHECK(has_avx512_bf16(), "paged_decode_attention needs AVX512-BF16");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "q must be [B, H, D] with contiguous D");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.sizes() == v_cache.sizes(), "caches must be contiguous [blocks, block_size, KvH, D]");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k_cache.scalar_type() == at::kBFloat16 &&
                  v_cache.scalar_type() == at::kBFloat16, "paged_decode_attention: q and the caches must be bf16");
  TORCH_CHECK(block_table.scalar_type() == at::kLong && block_table.stride(1) == 1 &&
                  seq_lens.scalar_type() == at::kLong && seq_lens.is_contiguous(),
              "block_table and seq_lens must be int64");
  const int64_t num_reqs = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_kv_heads = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == head_dim && num_heads % num_kv_heads == 0 && head_dim % 32 == 0 && head_dim <= 256,
              "head shapes do not match (or head_dim is not a multiple of 32 up to 256)");
  TORCH_CHECK(block_table.size(0) >= num_reqs && seq_lens.numel() >= num_reqs, "one table row per request");
  DecodeArgs a{num_kv_heads, num_heads / num_kv_heads, head_dim, k_cache.size(1),
               q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
               block_table.stride(0), window, static_cast<float>(scale)};
  at::Tensor out = at::empty({num_reqs, num_heads * head_dim}, q.options());
  decode_attention_bf16(a, reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>()),
                        reinterpret_cast<const uint16_t*>(k_cache.data_ptr<at::BFloat16>()),
                        reinterpret_cast<const uint16_t*>(v_cache.data_ptr<at::BFloat16>()),
                        block_table.data_ptr<int64_t>(), seq_lens.data_ptr<int64_t>(), num_reqs,
                        reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()));
  return out;
}

// ---- paged prefill attention (bf16) ---------------------------------------------------
// One request's new tokens (positions num_cached .. seq_len-1) attend causally over its keys
// in the paged cache (the new ones already written). Flash-style, per KV head and block of
// up to 16 query positions: the block's R = 16 x G query rows (G heads share the KV head)
// go through the keys 32 at a time with an online softmax; nothing [L, L]-sized is ever
// materialized. Both products are shaped like the linear kernel's tile, so neither needs
// a horizontal reduction:
//  * scores S^T [keys, rows]: the queries are packed once per block into dimension pairs
//    (lane = query row), each key's dimension pair is broadcast: one vdpbf16ps scores 16
//    rows. The row max and sum are then plain vertical operations across keys.
//  * P V: probabilities rounded to bf16 (as PyTorch's CPU SDPA does before its P @ V; the
//    denominator sums them unrounded) in key pairs, values interleaved in the same key
//    pairs: one vdpbf16ps does 2 keys x 16 dims for one row.

struct PrefillArgs {
  int64_t group, head_dim, block_size, q_stride_tok, q_stride_head, cache_stride_block, cache_stride_token;
  int64_t num_cached, seq_len, window;
  float scale;
};

constexpr int kPrefillKeys = 32;  // keys per chunk (even: probabilities pair up)

// Per-thread scratch of the prefill kernel, sized for R rows (a multiple of 16) and head_dim d.
struct PrefillScratch {
  std::vector<uint32_t> q_pairs, p_pairs, v_pairs;
  std::vector<float> scores, acc, row_max, row_sum, corr;
  std::vector<int32_t> pos, lo;  // per row: its position and first visible key
  void size_for(int64_t rows, int64_t d) {
    pos.resize(rows), lo.resize(rows);
    q_pairs.resize(rows * d / 2);
    scores.resize(kPrefillKeys * rows);
    p_pairs.resize(kPrefillKeys / 2 * rows);
    v_pairs.resize(kPrefillKeys / 2 * d);
    acc.resize(rows * d);
    row_max.resize(rows), row_sum.resize(rows), corr.resize(rows);
  }
};

// s[k][lanes of column c] = q_rows(c) . key k, for NK keys (rows of `keys`) and NC (<= 3)
// 16-row columns from c0: NK x NC accumulators over the head's dimension pairs.
template <int CH, int NK, int NC>
KV_AVX512_BF16 inline void score_strip(const uint32_t* q_pairs, int64_t c0, const uint16_t* const* keys,
                                       int64_t head_off, float* s, int64_t s_stride) {
  __m512 acc[NK][NC];
  for (int k = 0; k < NK; ++k)
    for (int c = 0; c < NC; ++c) acc[k][c] = _mm512_setzero_ps();
  for (int d2 = 0; d2 < CH * 8; ++d2) {
    __m512bh qv[NC];
    for (int c = 0; c < NC; ++c) qv[c] = (__m512bh)_mm512_loadu_si512(q_pairs + ((c0 + c) * CH * 8 + d2) * 16);
    for (int k = 0; k < NK; ++k) {
      uint32_t pair;
      std::memcpy(&pair, keys[k] + head_off + 2 * d2, sizeof(pair));
      const __m512bh kv = (__m512bh)_mm512_set1_epi32((int)pair);
      for (int c = 0; c < NC; ++c) acc[k][c] = _mm512_dpbf16_ps(acc[k][c], kv, qv[c]);
    }
  }
  for (int k = 0; k < NK; ++k)
    for (int c = 0; c < NC; ++c) _mm512_storeu_ps(s + k * s_stride + (c0 + c) * 16, acc[k][c]);
}

template <int CH>
KV_AVX512_BF16 void score_chunk(const uint32_t* q_pairs, int64_t cols, const uint16_t* const* keys, int n_keys,
                                int64_t head_off, float* s, int64_t s_stride) {
  int k = 0;
  for (; k + 8 <= n_keys; k += 8) {
    int64_t c = 0;
    for (; c + 3 <= cols; c += 3) score_strip<CH, 8, 3>(q_pairs, c, keys + k, head_off, s + k * s_stride, s_stride);
    for (; c < cols; ++c) score_strip<CH, 8, 1>(q_pairs, c, keys + k, head_off, s + k * s_stride, s_stride);
  }
  for (; k < n_keys; ++k) {
    int64_t c = 0;
    for (; c + 3 <= cols; c += 3) score_strip<CH, 1, 3>(q_pairs, c, keys + k, head_off, s + k * s_stride, s_stride);
    for (; c < cols; ++c) score_strip<CH, 1, 1>(q_pairs, c, keys + k, head_off, s + k * s_stride, s_stride);
  }
}

template <int CH>
KV_AVX512_BF16 void prefill_block_bf16(const PrefillArgs& a, const uint16_t* q, const uint16_t* kc,
                                       const uint16_t* vc, const int64_t* table, int64_t h, int64_t i0, int64_t nq,
                                       PrefillScratch& w, uint16_t* out, int64_t out_stride) {
  const int64_t g_n = a.group, d_n = a.head_dim, rows = nq * g_n, cols = (rows + 15) / 16, lanes = cols * 16;
  const int64_t p_first = a.num_cached + i0, p_last = p_first + nq - 1;
  const int64_t lo_first = a.window > 0 ? std::max<int64_t>(0, p_first - a.window + 1) : 0;
  // queries into dimension pairs, lane = row r = i * G + g (padding rows zero)
  uint32_t* qp = w.q_pairs.data();
  std::fill(qp, qp + cols * CH * 8 * 16, 0u);
  for (int64_t r = 0; r < rows; ++r) {
    const uint16_t* qr = q + (i0 + r / g_n) * a.q_stride_tok + (h * g_n + r % g_n) * a.q_stride_head;
    for (int d2 = 0; d2 < CH * 8; ++d2) std::memcpy(&qp[((r / 16) * CH * 8 + d2) * 16 + r % 16], qr + 2 * d2, 4);
  }
  // each lane's position and first visible key; padding lanes see nothing
  int32_t* pos = w.pos.data();
  int32_t* lo = w.lo.data();
  for (int64_t r = 0; r < lanes; ++r) {
    const int64_t p = r < rows ? p_first + r / g_n : -1;
    pos[r] = (int32_t)p;
    lo[r] = r < rows && a.window > 0 ? (int32_t)std::max<int64_t>(0, p - a.window + 1) : 0;
  }
  std::fill(w.acc.begin(), w.acc.begin() + lanes * d_n, 0.f);
  std::fill(w.row_max.begin(), w.row_max.begin() + lanes, -INFINITY);
  std::fill(w.row_sum.begin(), w.row_sum.begin() + lanes, 0.f);
  const uint16_t* keys[kPrefillKeys];
  const uint16_t* values[kPrefillKeys];
  float* s = w.scores.data();
  uint32_t* pp = w.p_pairs.data();
  const __m512 scale = _mm512_set1_ps(a.scale), neg_inf = _mm512_set1_ps(-INFINITY);
  for (int64_t t0 = lo_first; t0 <= p_last; t0 += kPrefillKeys) {
    const int n_keys = (int)std::min<int64_t>(kPrefillKeys, p_last + 1 - t0), n_pairs = (n_keys + 1) / 2;
    for (int k = 0; k < n_keys; k += 16) {
      const int n = std::min(16, n_keys - k);
      token_rows(kc, table, a.block_size, a.cache_stride_block, a.cache_stride_token, t0 + k, n, keys + k);
      token_rows(vc, table, a.block_size, a.cache_stride_block, a.cache_stride_token, t0 + k, n, values + k);
    }
    score_chunk<CH>(qp, cols, keys, n_keys, h * d_n, s, lanes);
    // online softmax per 16-row column: mask, new max, rescale factor, bf16 probability pairs
    for (int64_t c = 0; c < cols; ++c) {
      const __m512i pc = _mm512_loadu_si512(pos + 16 * c), lc = _mm512_loadu_si512(lo + 16 * c);
      __m512 mx = _mm512_loadu_ps(&w.row_max[16 * c]);
      const __m512 m_old = mx;
      for (int k = 0; k < n_keys; ++k) {
        const __m512i t = _mm512_set1_epi32((int)(t0 + k));
        const __mmask16 valid = _mm512_cmple_epi32_mask(t, pc) & _mm512_cmpge_epi32_mask(t, lc);
        const __m512 sk = _mm512_mask_mul_ps(neg_inf, valid, _mm512_loadu_ps(s + k * lanes + 16 * c), scale);
        _mm512_storeu_ps(s + k * lanes + 16 * c, sk);
        mx = _mm512_max_ps(mx, sk);
      }
      // rows that have seen no key yet keep -inf; subtract 0 there so nothing becomes NaN
      const __m512 base = _mm512_mask_mov_ps(mx, _mm512_cmp_ps_mask(mx, neg_inf, _CMP_EQ_OQ), _mm512_setzero_ps());
      const __m512 corr = exp_nonpositive(_mm512_sub_ps(m_old, base));
      __m512 sum = _mm512_mul_ps(_mm512_loadu_ps(&w.row_sum[16 * c]), corr);
      for (int j = 0; j < n_pairs; ++j) {
        __m512i two[2];
        for (int e = 0; e < 2; ++e) {
          const int k = 2 * j + e;
          __m512 p = _mm512_setzero_ps();
          if (k < n_keys) {
            const __m512 sk = _mm512_loadu_ps(s + k * lanes + 16 * c);
            p = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(sk, neg_inf, _CMP_NEQ_OQ), exp_nonpositive(_mm512_sub_ps(sk, base)));
          }
          sum = _mm512_add_ps(sum, p);
          two[e] = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(p));
        }
        _mm512_storeu_si512(pp + j * lanes + 16 * c, _mm512_or_si512(two[0], _mm512_slli_epi32(two[1], 16)));
      }
      _mm512_storeu_ps(&w.row_max[16 * c], mx);
      _mm512_storeu_ps(&w.row_sum[16 * c], sum);
      _mm512_storeu_ps(&w.corr[16 * c], corr);
    }
    // values into key pairs (dims in unpacklo/unpackhi order, see store_pair_row)
    __m512i* vp = reinterpret_cast<__m512i*>(w.v_pairs.data());
    for (int j = 0; j < n_pairs; ++j) {
      const uint16_t* r0 = values[2 * j] + h * d_n;
      const uint16_t* r1 = 2 * j + 1 < n_keys ? values[2 * j + 1] + h * d_n : nullptr;
      for (int c = 0; c < CH / 2; ++c) {
        const __m512i x = _mm512_loadu_si512(r0 + 32 * c);
        const __m512i y = r1 ? _mm512_loadu_si512(r1 + 32 * c) : _mm512_setzero_si512();
        _mm512_storeu_si512(vp + j * CH + 2 * c, _mm512_unpacklo_epi16(x, y));
        _mm512_storeu_si512(vp + j * CH + 2 * c + 1, _mm512_unpackhi_epi16(x, y));
      }
    }
    // acc[r] = acc[r] * corr[r] + sum over pairs of p pair x value pair, GB rows in registers
    constexpr int GB = CH >= 14 ? 1 : (28 - CH) / CH;
    for (int64_t r0 = 0; r0 < rows; r0 += GB) {
      const int gn = (int)std::min<int64_t>(GB, rows - r0);
      __m512 sum[GB][CH];
      for (int g = 0; g < GB; ++g)
        if (g < gn) {
          const __m512 cr = _mm512_set1_ps(w.corr[r0 + g]);
          for (int k = 0; k < CH; ++k) sum[g][k] = _mm512_mul_ps(_mm512_loadu_ps(&w.acc[(r0 + g) * d_n + 16 * k]), cr);
        }
      for (int j = 0; j < n_pairs; ++j) {
        __m512bh v[CH];
        for (int k = 0; k < CH; ++k) v[k] = (__m512bh)_mm512_loadu_si512(vp + j * CH + k);
        for (int g = 0; g < GB; ++g)
          if (g < gn) {
            const __m512bh p = (__m512bh)_mm512_set1_epi32((int)pp[j * lanes + r0 + g]);
            for (int k = 0; k < CH; ++k) sum[g][k] = _mm512_dpbf16_ps(sum[g][k], v[k], p);
          }
      }
      for (int g = 0; g < GB; ++g)
        if (g < gn)
          for (int k = 0; k < CH; ++k) _mm512_storeu_ps(&w.acc[(r0 + g) * d_n + 16 * k], sum[g][k]);
    }
  }
  for (int64_t r = 0; r < rows; ++r)
    store_pair_row<CH>(&w.acc[r * d_n], 1.f / w.row_sum[r],
                       out + (i0 + r / g_n) * out_stride + (h * g_n + r % g_n) * d_n);
}

template <int CH>
struct PrefillBf16 {
  static constexpr auto run = prefill_block_bf16<CH>;
};
using PrefillFn = decltype(&prefill_block_bf16<2>);

// q [Lq, H, D] bf16 (d contiguous) for positions seq_len - Lq .. seq_len - 1; caches
// [blocks, block_size, KvH, D]; block_table [max_blocks] int64 (this request's row) -> [Lq, H * D].
at::Tensor paged_prefill_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                   const at::Tensor& block_table, int64_t seq_len, double scale, int64_t window) {
  TORCH_CHECK(has_avx512_bf16(), "paged_prefill_attention needs AVX512-BF16");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.scalar_type() == at::kBFloat16, "q must be [Lq, H, D] bf16");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.sizes() == v_cache.sizes() && k_cache.scalar_type() == at::kBFloat16,
              "caches must be contiguous bf16 [blocks, block_size, KvH, D]");
  TORCH_CHECK(block_table.dim() == 1 && block_table.scalar_type() == at::kLong && block_table.is_contiguous(),
              "block_table must be one int64 row");
  const int64_t lq = q.size(0), num_heads = q.size(1), head_dim = q.size(2), num_kv_heads = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == head_dim && num_heads % num_kv_heads == 0 && head_dim % 32 == 0 && head_dim <= 256,
              "head shapes do not match (or head_dim is not a multiple of 32 up to 256)");
  TORCH_CHECK(seq_len >= lq && lq > 0 && block_table.numel() * k_cache.size(1) >= seq_len,
              "seq_len must cover the queries and fit the block table");
  const int64_t group = num_heads / num_kv_heads;
  PrefillArgs a{group, head_dim, k_cache.size(1), q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
                seq_len - lq, seq_len, window, static_cast<float>(scale)};
  at::Tensor out = at::empty({lq, num_heads * head_dim}, q.options());
  const auto* qp = reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>());
  const auto* kp = reinterpret_cast<const uint16_t*>(k_cache.data_ptr<at::BFloat16>());
  const auto* vp = reinterpret_cast<const uint16_t*>(v_cache.data_ptr<at::BFloat16>());
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const int64_t* table = block_table.data_ptr<int64_t>();
  const int64_t q_blocks = (lq + 15) / 16;
  const PrefillFn fn = for_head_dim<PrefillFn, PrefillBf16>(head_dim);
  // Later query blocks see more keys (causal): order them first, last, second, second to
  // last, ... so that each thread's contiguous share of items carries about the same work.
  at::parallel_for(0, q_blocks * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    PrefillScratch scratch;
    scratch.size_for(16 * group, head_dim);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t k = item / num_kv_heads, h = item % num_kv_heads;
      const int64_t qb = k % 2 == 0 ? k / 2 : q_blocks - 1 - k / 2;
      const int64_t i0 = qb * 16;
      fn(a, qp, kp, vp, table, h, i0, std::min<int64_t>(16, lq - i0), scratch, op, num_heads * head_dim);
    }
  });
  return out;
}

// ---- greedy argmax over bf16 logits ---------------------------------------------------
// torch.argmax on [B, vocab] bf16 runs one row at a time without SIMD here (~6 ms per step
// at batch 64 x 49152). Same result: the first index of the maximum (rows without NaN).

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

template <typename T>
inline T round_to(float v) { return static_cast<T>(v); }

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

// bf16 rounding of fp32 lanes, kept in fp32 (the model-dtype rounding of one PyTorch op)
KV_AVX512_BF16 inline __m512 round_bf16(__m512 v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
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

// exp on any fp32 input: the same polynomial as exp_nonpositive, clamped to where fp32 exp is finite.
KV_AVX512_BF16 inline __m512 exp_any(__m512 x) {
  return exp_nonpositive_unclamped(_mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-104.f)), _mm512_set1_ps(88.7f)));
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

bool has_avx512_bf16_op() { return has_avx512_bf16(); }

}  // namespace

TORCH_LIBRARY(kvserve, m) {
  m.def("has_avx512_bf16() -> bool", &has_avx512_bf16_op);
  m.def("linear_bf16(Tensor x, Tensor packed, Tensor? bias, int n) -> Tensor");
  m.impl("linear_bf16", c10::DispatchKey::CPU, TORCH_FN(linear_bf16));
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, Tensor seq_lens, "
        "float scale, int window) -> Tensor");
  m.impl("paged_decode_attention", c10::DispatchKey::CPU, TORCH_FN(paged_decode_attention));
  m.def("paged_prefill_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, int seq_len, "
        "float scale, int window) -> Tensor");
  m.impl("paged_prefill_attention", c10::DispatchKey::CPU, TORCH_FN(paged_prefill_attention));
  m.def("argmax_bf16(Tensor logits) -> Tensor");
  m.impl("argmax_bf16", c10::DispatchKey::CPU, TORCH_FN(argmax_bf16));
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.impl("silu_and_mul", c10::DispatchKey::CPU, TORCH_FN(silu_and_mul));
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.impl("rms_norm", c10::DispatchKey::CPU, TORCH_FN(rms_norm));
  m.def("add_rms_norm_(Tensor(a!) residual, Tensor x, Tensor weight, float eps) -> Tensor");
  m.impl("add_rms_norm_", c10::DispatchKey::CPU, TORCH_FN(add_rms_norm_));
  m.def("write_kv_cache(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots) -> ()");
  m.impl("write_kv_cache", c10::DispatchKey::CPU, TORCH_FN(write_kv_cache));
  m.def("rotary_(Tensor(a!) x, Tensor cos_sin, int num_heads, int head_dim) -> ()");
  m.impl("rotary_", c10::DispatchKey::CPU, TORCH_FN(rotary_));
}
