// Shared by kvserve's CPU kernels (see ops.cpp for the list): the AVX512-BF16 target
// attribute and CPU check, bf16/exp vector helpers, paged-cache row lookup.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

// AVX512-BF16 code lives in functions with this attribute and runs only when
// has_avx512_bf16() is true, so the library loads on any x86-64 CPU.
#define KV_AVX512_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")))

namespace kvserve {

inline bool has_avx512_bf16() {
  static const bool ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16");
  return ok;
}

template <typename T>
inline T round_to(float v) { return static_cast<T>(v); }

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

// bf16 rounding of fp32 lanes, kept in fp32 (the model-dtype rounding of one PyTorch op)
KV_AVX512_BF16 inline __m512 round_bf16(__m512 v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
}

// exp on any fp32 input: the same polynomial as exp_nonpositive, clamped to where fp32 exp is finite.
KV_AVX512_BF16 inline __m512 exp_any(__m512 x) {
  return exp_nonpositive_unclamped(_mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-104.f)), _mm512_set1_ps(88.7f)));
}

// A linear's optional bias: float32 [>= n], or nullptr.
inline const float* linear_bias(const c10::optional<at::Tensor>& bias, int64_t n) {
  if (!bias.has_value()) return nullptr;
  TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() >= n,
              "bias must be float32 [N]");
  return bias->data_ptr<float>();
}

// Rows per work item of a linear split into (block of rows, column block) items: block_m, or
// fewer (a multiple of tile_m) when there are too few column items to keep every thread busy.
inline int64_t linear_rows_per_item(int64_t m, int64_t col_items, int64_t tile_m, int64_t block_m) {
  const int64_t want_items = 8 * at::get_num_threads();
  if (col_items >= want_items) return block_m;
  const int64_t parts = (want_items + col_items - 1) / col_items;
  return std::clamp<int64_t>((m / parts + tile_m - 1) / tile_m * tile_m, tile_m, block_m);
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

}  // namespace kvserve
