// The AVX2 + FMA + F16C kernel set (AMD Zen 1-3, Intel Haswell and later, client CPUs without
// AVX-512): the kernels of kernels.h on 8-lane fp32 vectors. bf16 is widened in registers (a
// shift), int8 dot products use vpmaddubsw as llama.cpp's Q8_0 x Q8_0 does. Compiled with
// -mavx2 -mfma -mf16c (models/cpu_ops.py); set.cpp checks the CPU before handing the set out.
#pragma once

#include <immintrin.h>

#include "../kernel_common.h"

// Register arrays (a tile's accumulators) live in registers only when their loops are unrolled
// before register allocation.
#define KV_UNROLL _Pragma("GCC unroll 16")

namespace kvserve::avx2 {

// 8 bf16 -> 8 fp32 (exact)
inline __m256 load_bf16(const uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}

// The first n (< 8) of 8 bf16, zeros after.
inline __m256 load_bf16_partial(const uint16_t* p, int64_t n) {
  alignas(16) uint16_t tmp[8] = {};
  std::memcpy(tmp, p, n * sizeof(uint16_t));
  return load_bf16(tmp);
}

// 8 fp32 -> 8 bf16 bits, round to nearest even (NaN -> quiet NaN), in the low 128 bits' lanes.
inline __m128i to_bf16(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7FFF)), lsb), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
  // pack 8 x 32-bit (values < 2^16) into 8 x 16-bit
  const __m128i lo = _mm256_castsi256_si128(r), hi = _mm256_extracti128_si256(r, 1);
  return _mm_packus_epi32(lo, hi);
}

inline void store_bf16(uint16_t* p, __m256 v) { _mm_storeu_si128((__m128i*)p, to_bf16(v)); }

inline void store_bf16_partial(uint16_t* p, __m256 v, int64_t n) {
  alignas(16) uint16_t tmp[8];
  _mm_store_si128((__m128i*)tmp, to_bf16(v));
  std::memcpy(p, tmp, n * sizeof(uint16_t));
}

// bf16 rounding of fp32 lanes, kept in fp32 (the model-dtype rounding of one PyTorch op)
inline __m256 round_bf16(__m256 v) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(to_bf16(v)), 16));
}

// round_bf16 for finite lanes (no NaN check: cheaper in the softmax loops, whose values are finite)
inline __m256 round_finite_bf16(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7FFF)), lsb);
  return _mm256_castsi256_ps(_mm256_and_si256(r, _mm256_set1_epi32((int)0xFFFF0000u)));
}

inline float hsum(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

inline float hmax(__m256 v) {
  const __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(t, _mm_movehdup_ps(t)));
}

// exp on [-87, 88] (inputs are clamped there; below -87 gives 0): Cephes' degree-6 polynomial
// after reducing by ln 2 (the AVX-512 set's polynomial), 2^n built in the exponent bits.
inline __m256 exp_clamped(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.f);
  const __m256 underflow = _mm256_cmp_ps(x, lo, _CMP_GT_OQ);
  x = _mm256_min_ps(_mm256_max_ps(x, lo), _mm256_set1_ps(88.f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i pow2 = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(pow2)), underflow);
}

// exp for x <= 0 (scores minus their max) and for any x (silu), both exp_clamped.
inline __m256 exp_nonpositive(__m256 x) { return exp_clamped(x); }
inline __m256 exp_any(__m256 x) { return exp_clamped(x); }

#include "../set_kernels.h"

}  // namespace kvserve::avx2
