// Declarations shared by the training attention kernels: attention.cc (AVX-512, float32 and
// bfloat16) and attention_amx.cc (bfloat16 products on AMX tiles).
#pragma once

#include <cstdint>

#include "simd.h"

#ifdef BA_AVX512

namespace ba_attention {

struct Dims {
  int64_t B, T, S, N, K, H;
  int64_t Sp, Hp;  // S and H rounded up to multiples of 16 and 64
};

inline __mmask16 Lanes(int64_t n) {
  return n >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << n) - 1);
}

// Unmasked slots among the 16 (or fewer, n) mask bytes at m.
inline __mmask16 Valid16(const bool* m, int64_t n) {
  const __m128i bytes = _mm_maskz_loadu_epi8(Lanes(n), m);
  return _mm_cmpneq_epi8_mask(bytes, _mm_setzero_si128());
}

// Position tables of row b: sin/cos [B, T, H] (slots use the same positions as queries).
struct RopeTables {
  const float* sin;
  const float* cos;
  const float* Sin(const Dims& d, int64_t b, int64_t t) const { return sin + (b * d.T + t) * d.H; }
  const float* Cos(const Dims& d, int64_t b, int64_t t) const { return cos + (b * d.T + t) * d.H; }
};

// AMX (attention_amx.cc): whether the processor has AMX-BF16 with the tile state granted and
// the path is enabled (BaAttentionUseAmx), and the bf16 forward and backward of one (row, kv
// head) unit with the numerics of attention.cc's units.
bool AmxEnabled();
void AmxForwardUnit(const Dims& d, const uint16_t* q, const uint16_t* k, const uint16_t* v,
                    const bool* mask, const RopeTables& rope, float* o, int64_t b, int64_t kh);
void AmxBackwardUnit(const Dims& d, const uint16_t* q, const uint16_t* k, const uint16_t* v,
                     const bool* mask, const RopeTables& rope, const float* o,
                     const uint16_t* dout, uint16_t* dq, uint16_t* dk, uint16_t* dv,
                     int64_t b, int64_t kh);

}  // namespace ba_attention

#endif  // BA_AVX512
