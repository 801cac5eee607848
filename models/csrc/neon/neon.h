// The ARM64 NEON kernel set (ARMv8.2-A with the dot-product extension: Graviton 2 and later,
// Ampere Altra, Apple silicon): the kernels of kernels.h on 4-lane fp32 vectors. bf16 is widened
// in registers (a shift), int8 dot products use sdot (vdotq_s32). Compiled with
// -march=armv8.2-a+dotprod (models/cpu_isa.py); set.cpp checks the CPU before handing the set out.
#pragma once

#include <arm_neon.h>

#include "../kernel_common.h"

namespace kvserve::neon {

// 4 bf16 -> 4 fp32 (exact)
inline float32x4_t widen_bf16(uint16x4_t v) { return vreinterpretq_f32_u32(vshll_n_u16(v, 16)); }
inline float32x4_t load_bf16(const uint16_t* p) { return widen_bf16(vld1_u16(p)); }

// The first n (< 4) of 4 bf16, zeros after.
inline float32x4_t load_bf16_partial(const uint16_t* p, int64_t n) {
  uint16_t tmp[4] = {};
  std::memcpy(tmp, p, n * sizeof(uint16_t));
  return load_bf16(tmp);
}

// 4 fp32 -> 4 bf16 bits, round to nearest even (NaN -> quiet NaN), as float_to_bf16.
inline uint16x4_t to_bf16(float32x4_t v) {
  const uint32x4_t bits = vreinterpretq_u32_f32(v);
  const uint32x4_t lsb = vandq_u32(vshrq_n_u32(bits, 16), vdupq_n_u32(1));
  const uint16x4_t r = vshrn_n_u32(vaddq_u32(vaddq_u32(bits, vdupq_n_u32(0x7FFF)), lsb), 16);
  const uint16x4_t is_num = vmovn_u32(vceqq_f32(v, v));
  return vbsl_u16(is_num, r, vdup_n_u16(0x7FC0));
}

inline void store_bf16(uint16_t* p, float32x4_t v) { vst1_u16(p, to_bf16(v)); }

inline void store_bf16_partial(uint16_t* p, float32x4_t v, int64_t n) {
  uint16_t tmp[4];
  vst1_u16(tmp, to_bf16(v));
  std::memcpy(p, tmp, n * sizeof(uint16_t));
}

// bf16 rounding of fp32 lanes, kept in fp32 (the model-dtype rounding of one PyTorch op)
inline float32x4_t round_bf16(float32x4_t v) { return widen_bf16(to_bf16(v)); }

// The first n (< 4) of 4 floats, `fill` after.
inline float32x4_t load_f32_partial(const float* p, int64_t n, float fill) {
  float tmp[4] = {fill, fill, fill, fill};
  std::memcpy(tmp, p, n * sizeof(float));
  return vld1q_f32(tmp);
}

// Lanes i < n all ones (n may be >= 4).
inline uint32x4_t first_lanes(int64_t n) {
  const uint32_t idx[4] = {0, 1, 2, 3};
  return vcltq_u32(vld1q_u32(idx), vdupq_n_u32((uint32_t)std::min<int64_t>(n, 4)));
}

// exp on [-104, 88.7]: Cephes' degree-6 polynomial after reducing by ln 2 (the AVX-512 set's
// polynomial), times 2^n as two factors 2^(n/2) so that each is a normal float while n runs
// from -150 to 128 (vscalefps's result, denormals and all).
inline float32x4_t exp_in_range(float32x4_t x) {
  const float32x4_t n = vrndnq_f32(vmulq_n_f32(x, 1.44269504088896341f));
  float32x4_t r = vfmsq_f32(x, n, vdupq_n_f32(0.693359375f));
  r = vfmsq_f32(r, n, vdupq_n_f32(-2.12194440e-4f));
  float32x4_t p = vdupq_n_f32(1.9875691500e-4f);
  p = vfmaq_f32(vdupq_n_f32(1.3981999507e-3f), p, r);
  p = vfmaq_f32(vdupq_n_f32(8.3334519073e-3f), p, r);
  p = vfmaq_f32(vdupq_n_f32(4.1665795894e-2f), p, r);
  p = vfmaq_f32(vdupq_n_f32(1.6666665459e-1f), p, r);
  p = vfmaq_f32(vdupq_n_f32(5.0000001201e-1f), p, r);
  p = vfmaq_f32(vaddq_f32(r, vdupq_n_f32(1.f)), p, vmulq_f32(r, r));
  const int32x4_t ni = vcvtq_s32_f32(n);
  const int32x4_t n1 = vshrq_n_s32(ni, 1), n2 = vsubq_s32(ni, n1);
  const float32x4_t s1 = vreinterpretq_f32_s32(vshlq_n_s32(vaddq_s32(n1, vdupq_n_s32(127)), 23));
  const float32x4_t s2 = vreinterpretq_f32_s32(vshlq_n_s32(vaddq_s32(n2, vdupq_n_s32(127)), 23));
  return vmulq_f32(vmulq_f32(p, s1), s2);
}

// exp for x <= 0 (scores minus their max; -inf gives 0) and for any x (silu).
inline float32x4_t exp_nonpositive(float32x4_t x) { return exp_in_range(vmaxq_f32(x, vdupq_n_f32(-104.f))); }
inline float32x4_t exp_any(float32x4_t x) {
  return exp_in_range(vminq_f32(vmaxq_f32(x, vdupq_n_f32(-104.f)), vdupq_n_f32(88.7f)));
}

#include "../set_kernels.h"

}  // namespace kvserve::neon
