// AVX-512 helpers shared by the native kernels (defines BA_AVX512 when they are compiled).
#pragma once

#include <cstdint>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define BA_AVX512 1

// Up to 16 values from p (lanes >= n are zero), as float32.
inline __m512 Load16(const float* p, int64_t n) {
  return n >= 16 ? _mm512_loadu_ps(p) : _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n) - 1), p);
}
inline __m512 Load16(const uint16_t* p, int64_t n) {  // bf16 bits shifted into the high half
  __m256i h = n >= 16 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))
                      : _mm256_maskz_loadu_epi16(static_cast<__mmask16>((1u << n) - 1), p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// exp(x) for 16 lanes (Cephes expf: range reduction by ln 2, degree-6 polynomial); lanes
// below -87.3 (underflow, and -inf for masked slots) give exactly 0.
inline __m512 Exp16(__m512 x) {
  const __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.3f), _CMP_GE_OQ);
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3f)), _mm512_set1_ps(88.7f));
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  __m512 y = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_maskz_mov_ps(live, _mm512_scalef_ps(y, n));
}

// x rounded to the nearest bfloat16 (ties to even), kept as float32; NaN stays NaN.
inline __m512 RoundBf16(__m512 x) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i bias = _mm512_add_epi32(_mm512_set1_epi32(0x7fff),
                                        _mm512_and_si512(_mm512_srli_epi32(u, 16),
                                                         _mm512_set1_epi32(1)));
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(
      _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
  const __m512i r = _mm512_and_si512(_mm512_add_epi32(u, bias), _mm512_set1_epi32(0xffff0000));
  return _mm512_castsi512_ps(_mm512_mask_mov_epi32(r, nan, u));
}

// x rounded to the element type of the tag: float32 (identity) or bfloat16 (uint16_t).
inline __m512 Round(__m512 x, float) { return x; }
inline __m512 Round(__m512 x, uint16_t) { return RoundBf16(x); }

// Up to 16 float32 lanes stored at p (n < 16: the first n), as float32 or as bfloat16
// (rounded to nearest even).
inline void Store16(float* p, __m512 x, int64_t n) {
  if (n >= 16) {
    _mm512_storeu_ps(p, x);
  } else {
    _mm512_mask_storeu_ps(p, static_cast<__mmask16>((1u << n) - 1), x);
  }
}
inline void Store16(uint16_t* p, __m512 x, int64_t n) {
  // a NaN whose payload sits below the kept bits is made quiet, so it stays a NaN
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  const __m512i u = _mm512_mask_or_epi32(_mm512_castps_si512(RoundBf16(x)), nan,
                                         _mm512_castps_si512(x), _mm512_set1_epi32(0x00400000));
  const __m256i h = _mm512_cvtepi32_epi16(_mm512_srli_epi32(u, 16));
  if (n >= 16) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), h);
  } else {
    _mm256_mask_storeu_epi16(p, static_cast<__mmask16>((1u << n) - 1), h);
  }
}

// n float32 values of src stored at dst, as float32 or rounded to bfloat16 (by dst's type).
template <typename T>
inline void StoreRow(T* dst, const float* src, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) Store16(dst + i, Load16(src + i, n - i), n - i);
}

#endif  // AVX-512
