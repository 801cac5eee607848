// The AVX-512 kernel sets, one source for two builds:
// * `avx512` (Intel Cooper Lake / Sapphire Rapids and later, AMD Zen 4 and later): bf16 dot
//   products (vdpbf16ps), int8 dot products (vpdpbusd) and, where the CPU has them, AMX tiles
//   for the bf16 linear;
// * `avx512vnni` (Intel Cascade Lake, Ice Lake, Tiger/Rocket Lake: AVX-512 and VNNI without
//   BF16): the same kernels with bf16 widened in registers and fp32 FMAs where vdpbf16ps was.
// Which one a build is follows its flags (models/cpu_isa.py): __AVX512BF16__ or not. set.cpp
// checks the CPU before handing the set out. Shared here: the vector helpers of the kernels.
#pragma once

#include <immintrin.h>

#include "../kernel_common.h"

// The kernels were written as target-attributed functions in a library built for any x86-64;
// the set is now compiled for its instructions as a whole, so the attributes are empty.
#define KV_AVX512_BF16
#define KV_AVX512_VNNI
#define KV_AMX

namespace kvserve::avx512 {

// 16 fp32 -> 16 bf16 bits, round to nearest even. vcvtneps2bf16 where the CPU has it; else the
// same rounding in integer ops (NaN -> quiet NaN), which keeps denormals as PyTorch does.
inline __m256i to_bf16(__m512 v) {
#ifdef __AVX512BF16__
  return (__m256i)_mm512_cvtneps_pbh(v);
#else
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7FFF)), lsb), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(r);
#endif
}

// 32 bf16 as 16 pairs: the operand of one pair dot product (dot_pairs).
#ifdef __AVX512BF16__
using Pairs = __m512bh;
#else
using Pairs = __m512i;
#endif
inline Pairs as_pairs(__m512i v) { return (Pairs)v; }
// 32 bf16 from memory as pairs. With BF16, loaded as that type: a cast of a loaded __m512i
// makes GCC 12 bounce some of them through the stack in the attention loops.
inline Pairs load_pairs(const void* p) {
#ifdef __AVX512BF16__
  Pairs v;
  std::memcpy(&v, p, sizeof(v));
  return v;
#else
  return _mm512_loadu_si512(p);
#endif
}

// acc + a[2i] * b[2i] + a[2i+1] * b[2i+1] per fp32 lane i, a and b bf16 pairs: one vdpbf16ps,
// or two FMAs on the pairs widened (the odd elements are their lane's high half already).
inline __m512 dot_pairs(__m512 acc, Pairs a, Pairs b) {
#ifdef __AVX512BF16__
  return _mm512_dpbf16_ps(acc, a, b);
#else
  const __m512i high = _mm512_set1_epi32((int)0xFFFF0000u);
  acc = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_and_si512(a, high)),
                        _mm512_castsi512_ps(_mm512_and_si512(b, high)), acc);
  return _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(a, 16)),
                         _mm512_castsi512_ps(_mm512_slli_epi32(b, 16)), acc);
#endif
}

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
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(to_bf16(v)), 16));
}

// exp on any fp32 input: the same polynomial as exp_nonpositive, clamped to where fp32 exp is finite.
KV_AVX512_BF16 inline __m512 exp_any(__m512 x) {
  return exp_nonpositive_unclamped(_mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-104.f)), _mm512_set1_ps(88.7f)));
}

// One accumulated row (dims in unpack order: per 32-dim chunk, `lo` lane 4i+j is dim 8i+j
// and `hi` lane 4i+j is dim 8i+4+j; ch x 16 dims) times inv, written as bf16 in natural order.
KV_AVX512_BF16 inline void store_pair_row(const float* acc, int64_t ch, float inv, uint16_t* out) {
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  const __m512 scale = _mm512_set1_ps(inv);
  for (int64_t c = 0; c < ch / 2; ++c) {
    const __m512 lo = _mm512_loadu_ps(acc + 32 * c), hi = _mm512_loadu_ps(acc + 32 * c + 16);
    _mm256_storeu_si256((__m256i*)(out + 32 * c),
                        to_bf16(_mm512_mul_ps(_mm512_permutex2var_ps(lo, first, hi), scale)));
    _mm256_storeu_si256((__m256i*)(out + 32 * c + 16),
                        to_bf16(_mm512_mul_ps(_mm512_permutex2var_ps(lo, second, hi), scale)));
  }
}

// AMX tiles for the bf16 linear (linear.cpp): whether the CPU and the OS allow them; on / off.
bool has_amx();
bool set_amx(bool enabled);

// Whether the one-row tiles (linear.cpp, quant_linear.cpp) prefetch their weight stream a few KiB
// ahead; set once when the set loads (set.cpp). On AMD (Zen 4) the hardware's prefetchers keep up
// with these tiles' full-line loads and the prefetches only slowed a decode step; Intel CPUs,
// where they were measured, keep them.
inline bool& prefetch_streams() {
  static bool on = true;
  return on;
}

#include "../set_kernels.h"

}  // namespace kvserve::avx512
