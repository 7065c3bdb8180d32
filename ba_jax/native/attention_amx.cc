// The bfloat16 path of the training attention (attention.cc) with its products on Intel AMX
// tiles: the forward and backward of one (row, kv head) unit.
//
// Why: in bf16 every operand of attention's five products is already a bf16 value (the rotated
// q and k, v, do, and the probabilities and score gradients, which the numerics round to bf16
// before their products), so the tile unit computes the same float32 products of bf16 values
// with float32 sums as attention.cc's FMA loops (only the order of the sums differs), at a rate
// those loops cannot reach (they ran at ~22 GFLOP/s per thread, ~20% of the train step).
// Masking, softmax, rotary embedding and the roundings stay in AVX-512 float32, as there.
//
// Query rows of one head go 32 at a time (two 16-row tiles) through
//   scores  S = Q K^T     A: Q rows [32, H]     B: K paired over h     (kh)
//   forward O = P V       A: P rows [32, S]     B: V paired over keys  (vs)
//   dP = dO V^T           A: dO rows            B: V paired over h     (vh)
//   dQ = dS K             A: dS rows            B: K paired over keys  (ks)
//   dV^T += dO^T P        A: dO^T [H, 32]       B: P paired over the 32 rows
//   dK^T += Q^T dS        A: Q^T [H, 32]        B: dS paired over the 32 rows
// where a B tile holds 16 rows of bf16 pairs along the contracted axis (row r, column c:
// X[2r, c] and X[2r + 1, c]). Only the 16-key blocks that hold an unmasked slot of one of the
// 32 rows are computed (a causal mask skips about half); H and S are zero-padded to 32.

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "amx.h"
#include "attention.h"

namespace {
std::atomic<bool> use_amx{true};
}  // namespace

// Python's switch between this path and the AVX-512 one (tests run both).
extern "C" void BaAttentionUseAmx(int on) { use_amx.store(on != 0); }

#ifdef BA_AVX512

namespace ba_attention {
namespace {

constexpr int64_t kRows = 32;   // query rows per chunk (two A tiles)
constexpr int64_t kTileElems = 512;  // bf16 elements of one 16 x 64-byte tile

inline int64_t Up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

using ba_amx::ConfigureTiles;

// Per-thread buffers of one unit, kept between calls (S32, H32: S and H padded to 32).
struct Work {
  int64_t S32 = -1, H32 = -1, NB = 0;    // NB: 16-key blocks
  std::vector<uint16_t> xb;              // [S32, H32] bf16 rows being packed
  std::vector<uint16_t> kh, ks, vh, vs;  // packed B operands (S32 * H32 each)
  std::vector<uint16_t> qa, ga;          // the chunk's q (rotated) and do rows [32, H32]
  std::vector<uint16_t> qt, gt;          // their transposes [H32, 32]
  std::vector<float> sc, dp;             // scores -> exp(score - max), and dP [32, S32]
  std::vector<uint16_t> pa, da;          // probabilities and dS as bf16 rows [32, S32]
  std::vector<uint16_t> pp, dsp;         // the same paired over the 32 rows
  std::vector<float> dkt, dvt;           // dK^T, dV^T [H32, S32]
  std::vector<float> out;                // [32, H32]
  std::vector<__mmask16> ok;             // [32, NB] unmasked slots of each row and block
  std::vector<uint8_t> live, live32;     // 16-key blocks / 32-key chunks with an unmasked slot
  std::vector<uint8_t> use, use32;       // those holding a nonzero p
  void Resize(int64_t s32, int64_t h32) {
    if (s32 == S32 && h32 == H32) return;
    S32 = s32;
    H32 = h32;
    NB = S32 / 16;
    for (auto* x : {&xb, &kh, &ks, &vh, &vs}) x->assign(S32 * H32, 0);
    for (auto* x : {&qa, &ga, &qt, &gt}) x->assign(kRows * H32, 0);
    for (auto* x : {&sc, &dp}) x->assign(kRows * S32, 0.0f);
    for (auto* x : {&pa, &da, &pp, &dsp}) x->assign(kRows * S32, 0);
    for (auto* x : {&dkt, &dvt}) x->assign(H32 * S32, 0.0f);
    out.assign(kRows * H32, 0.0f);
    ok.assign(kRows * NB, 0);
    live.assign(NB, 0);
    use.assign(NB, 0);
    use32.assign(NB / 2, 0);
    live32.assign(NB / 2, 0);
  }
};

// Per-row state of a chunk's softmax: exp(score - max) sits in Work::sc on the row's live
// blocks; p = e * inv on its unmasked slots. A uniform row (no unmasked slot) has e = 1 on
// all S slots and inv = 1 / S.
struct RowStats {
  int64_t valid[kRows];
  float inv[kRows];
  bool uniform[kRows];
  bool any_uniform;
};

inline __mmask32 Lanes32(int64_t n) {
  return n >= 32 ? ~__mmask32{0} : static_cast<__mmask32>((1u << n) - 1);
}

// n (<= H32) bf16 values into dst [H32], zero-padded.
inline void CopyBf16Row(const uint16_t* src, int64_t n, int64_t H32, uint16_t* dst) {
  for (int64_t h = 0; h < H32; h += 32) {
    _mm512_storeu_si512(dst + h, _mm512_maskz_loadu_epi16(Lanes32(n - h), src + h));
  }
}

// The rotary embedding of one bf16 row (HF rotate-half, as `Rope`), rounded to bf16 into
// dst [H32], zero-padded.
inline void RopeBf16Row(const Dims& d, const uint16_t* x, const float* sin, const float* cos,
                        int64_t H32, uint16_t* dst) {
  const int64_t half = d.H / 2;
  std::fill(dst + d.H, dst + H32, uint16_t{0});
  for (int64_t h = 0; h < half; h += 16) {
    const int64_t n = half - h;
    const __m512 x1 = Load16(x + h, n), x2 = Load16(x + half + h, n);
    const __m512 y1 =
        _mm512_fmsub_ps(x1, Load16(cos + h, n), _mm512_mul_ps(x2, Load16(sin + h, n)));
    const __m512 y2 = _mm512_fmadd_ps(x2, Load16(cos + half + h, n),
                                      _mm512_mul_ps(x1, Load16(sin + half + h, n)));
    Store16(dst + h, y1, n);
    Store16(dst + half + h, y2, n);
  }
}

// The transpose of the rotation for a float32 gradient row g (rounded to bf16 first, as
// `RopeGrad`), stored as float32 into dst [H].
inline void RopeGradRow(const Dims& d, const float* g, const float* sin, const float* cos,
                        uint16_t* dst) {
  const int64_t half = d.H / 2;
  for (int64_t h = 0; h < half; h += 16) {
    const int64_t n = half - h;
    const __m512 g1 = RoundBf16(Load16(g + h, n)), g2 = RoundBf16(Load16(g + half + h, n));
    const __m512 y1 = _mm512_fmadd_ps(g1, Load16(cos + h, n),
                                      _mm512_mul_ps(g2, Load16(sin + half + h, n)));
    const __m512 y2 = _mm512_fmsub_ps(g2, Load16(cos + half + h, n),
                                      _mm512_mul_ps(g1, Load16(sin + h, n)));
    Store16(dst + h, y1, n);
    Store16(dst + half + h, y2, n);
  }
}

// x[s, kh, :] of row b for s < S into w.xb [S32, H32] (keys rotated), the padding zero.
void LoadSlots(const Dims& d, const uint16_t* x, int64_t b, int64_t kh, const RopeTables* rope,
               Work& w) {
  for (int64_t s = 0; s < d.S; ++s) {
    const uint16_t* src = x + ((b * d.S + s) * d.K + kh) * d.H;
    uint16_t* dst = w.xb.data() + s * w.H32;
    if (rope != nullptr) {
      RopeBf16Row(d, src, rope->Sin(d, b, s), rope->Cos(d, b, s), w.H32, dst);
    } else {
      CopyBf16Row(src, d.H, w.H32, dst);
    }
  }
  std::fill(w.xb.begin() + d.S * w.H32, w.xb.end(), uint16_t{0});
}

// x [S32, H32] paired over h: tile (j, c) (16 keys j, 32 dims c), row r, column key =
// (x[16j + key, 32c + 2r], x[16j + key, 32c + 2r + 1]): the B operand of a product
// contracting h (S = Q K^T, dP = dO V^T).
void PairOverH(const uint16_t* xb, int64_t S32, int64_t H32, uint16_t* out) {
  const auto* x = reinterpret_cast<const uint32_t*>(xb);
  auto* o = reinterpret_cast<uint32_t*>(out);
  const int64_t C = H32 / 32, W = H32 / 2;
  for (int64_t j = 0; j < S32 / 16; ++j)
    for (int64_t c = 0; c < C; ++c)
      for (int64_t r = 0; r < 16; ++r)
        for (int64_t key = 0; key < 16; ++key)
          o[((j * C + c) * 16 + r) * 16 + key] = x[(j * 16 + key) * W + c * 16 + r];
}

// x [rows, cols] (row stride ld, rows a multiple of 32, cols of 16) paired over its rows:
// tile (c, jb) (32 rows c, 16 columns jb), row r, column i = (x[32c + 2r, 16jb + i],
// x[32c + 2r + 1, 16jb + i]): the B operand of a product contracting the rows.
void PairOverRows(const uint16_t* x, int64_t rows, int64_t cols, int64_t ld, uint16_t* out) {
  const int64_t JB = cols / 16;
  for (int64_t c = 0; c < rows / 32; ++c)
    for (int64_t jb = 0; jb < JB; ++jb) {
      uint16_t* tile = out + (c * JB + jb) * kTileElems;
      for (int64_t r = 0; r < 16; ++r) {
        const uint16_t* even = x + (32 * c + 2 * r) * ld + 16 * jb;
        const __m512i lo = _mm512_cvtepu16_epi32(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(even)));
        const __m512i hi = _mm512_cvtepu16_epi32(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(even + ld)));
        _mm512_storeu_si512(tile + 32 * r, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
      }
    }
}

// c [32, S32] = a [32, H32] . x^T on the live 16-key blocks, x paired over h (PairOverH).
BA_AMX void RowsTimesPairH(const uint16_t* a, int64_t H32, const uint16_t* x,
                           const uint8_t* live, int64_t S32, float* c) {
  const int64_t C = H32 / 32;
  for (int64_t j = 0; j < S32 / 16; ++j) {
    if (!live[j]) continue;
    _tile_zero(0);
    _tile_zero(1);
    const uint16_t* xj = x + j * C * kTileElems;
    for (int64_t cc = 0; cc < C; ++cc) {
      _tile_loadd(4, a + cc * 32, H32 * 2);
      _tile_loadd(5, a + 16 * H32 + cc * 32, H32 * 2);
      _tile_loadd(6, xj + cc * kTileElems, 64);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 5, 6);
    }
    _tile_stored(0, c + j * 16, S32 * 4);
    _tile_stored(1, c + 16 * S32 + j * 16, S32 * 4);
  }
}

// c [32, H32] = a [32, S32] . x over the live 32-key chunks, x [S32, H32] paired over its rows.
BA_AMX void RowsTimesPairRows(const uint16_t* a, int64_t S32, const uint16_t* x,
                              const uint8_t* live32, int64_t H32, float* c) {
  const int64_t HB = H32 / 16;
  for (int64_t hb = 0; hb < HB; hb += 2) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t cc = 0; cc < S32 / 32; ++cc) {
      if (!live32[cc]) continue;
      const uint16_t* xc = x + (cc * HB + hb) * kTileElems;
      _tile_loadd(4, a + cc * 32, S32 * 2);
      _tile_loadd(5, a + 16 * S32 + cc * 32, S32 * 2);
      _tile_loadd(6, xc, 64);
      _tile_loadd(7, xc + kTileElems, 64);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
    float* dst = c + hb * 16;
    _tile_stored(0, dst, H32 * 4);
    _tile_stored(1, dst + 16, H32 * 4);
    _tile_stored(2, dst + 16 * H32, H32 * 4);
    _tile_stored(3, dst + 16 * H32 + 16, H32 * 4);
  }
}

// ct [H32, S32] += at [H32, 32] . y on the live 16-key blocks, y [32, S32] paired over rows.
BA_AMX void AddTransposed(const uint16_t* at, const uint16_t* y, const uint8_t* live,
                          int64_t H32, int64_t S32, float* ct) {
  for (int64_t j = 0; j < S32 / 16; ++j) {
    if (!live[j]) continue;
    _tile_loadd(6, y + j * kTileElems, 64);
    for (int64_t hb = 0; hb < H32 / 16; hb += 2) {
      float* dst = ct + hb * 16 * S32 + j * 16;
      _tile_loadd(0, dst, S32 * 4);
      _tile_loadd(1, dst + 16 * S32, S32 * 4);
      _tile_loadd(4, at + hb * 16 * kRows, 64);
      _tile_loadd(5, at + (hb + 1) * 16 * kRows, 64);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 5, 6);
      _tile_stored(0, dst, S32 * 4);
      _tile_stored(1, dst + 16 * S32, S32 * 4);
    }
  }
}

// The chunk's unmasked slots per row and 16-key block (w.ok), its live blocks and each row's
// count of unmasked slots (rows r < R; m is the mask row of the chunk's first query).
void ChunkMasks(const Dims& d, const bool* m, int64_t R, Work& w, RowStats& st) {
  std::fill(w.live.begin(), w.live.end(), uint8_t{0});
  std::fill(w.ok.begin(), w.ok.end(), __mmask16{0});
  for (int64_t r = 0; r < R; ++r) {
    int64_t valid = 0;
    __mmask16* ok = w.ok.data() + r * w.NB;
    for (int64_t s0 = 0; s0 < d.S; s0 += 16) {
      ok[s0 / 16] = Valid16(m + r * d.S + s0, d.S - s0);
      if (ok[s0 / 16]) {
        w.live[s0 / 16] = 1;
        valid += __builtin_popcount(ok[s0 / 16]);
      }
    }
    st.valid[r] = valid;
  }
  for (int64_t r = R; r < kRows; ++r) st.valid[r] = 0;
}

// Row r's raw q.k products (live blocks of w.sc) -> exp(scale * x - max) over its unmasked
// slots (0 on its masked ones) and st.inv[r] = 1 / sum.
void SoftmaxRow(const Dims& d, Work& w, int64_t r, float scale, RowStats& st) {
  float* sc = w.sc.data() + r * w.S32;
  const __mmask16* ok = w.ok.data() + r * w.NB;
  st.uniform[r] = st.valid[r] == 0;
  if (st.uniform[r]) {
    std::fill(sc, sc + w.S32, 1.0f);
    st.inv[r] = 1.0f / d.S;
    return;
  }
  const __m512 sv = _mm512_set1_ps(scale);
  __m512 mx = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t j = 0; j < w.NB; ++j) {
    if (ok[j]) mx = _mm512_mask_max_ps(mx, ok[j], mx, _mm512_mul_ps(_mm512_loadu_ps(sc + 16 * j), sv));
  }
  const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
  __m512 total = _mm512_setzero_ps();
  for (int64_t j = 0; j < w.NB; ++j) {
    if (!ok[j]) continue;
    const __m512 x = _mm512_sub_ps(_mm512_mul_ps(_mm512_loadu_ps(sc + 16 * j), sv), top);
    const __m512 e = _mm512_maskz_mov_ps(ok[j], Exp16(x));
    _mm512_storeu_ps(sc + 16 * j, e);
    total = _mm512_add_ps(total, e);
  }
  st.inv[r] = 1.0f / _mm512_reduce_add_ps(total);
}

// The slots of row r in block j where p may be nonzero.
inline __mmask16 PMask(const Dims& d, const Work& w, const RowStats& st, int64_t r, int64_t j) {
  if (st.uniform[r]) return 16 * j < d.S ? Lanes(d.S - 16 * j) : __mmask16{0};
  return w.ok[r * w.NB + j];
}

// Scores of the chunk's rows (w.qa: their rotated q) and their softmax state; rows >= R have
// no slot. Sets w.use / w.use32 (blocks, 32-key chunks holding a nonzero p) and w.live32.
BA_AMX void ChunkSoftmax(const Dims& d, const bool* m, int64_t R, float scale, Work& w,
                         RowStats& st) {
  ChunkMasks(d, m, R, w, st);
  RowsTimesPairH(w.qa.data(), w.H32, w.kh.data(), w.live.data(), w.S32, w.sc.data());
  st.any_uniform = false;
  for (int64_t r = 0; r < kRows; ++r) {
    if (r < R) {
      SoftmaxRow(d, w, r, scale, st);
      st.any_uniform |= st.uniform[r];
    } else {
      st.uniform[r] = false;
      st.inv[r] = 0.0f;
    }
  }
  for (int64_t j = 0; j < w.NB; ++j) w.use[j] = st.any_uniform || w.live[j];
  for (int64_t c = 0; c < w.NB / 2; ++c) {
    w.use32[c] = w.use[2 * c] || w.use[2 * c + 1];
    w.live32[c] = w.live[2 * c] || w.live[2 * c + 1];
  }
}

// bf16 bits of 16 float32 lanes as 16-bit lanes.
inline __m256i Bf16Bits(__m512 x) {
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(RoundBf16(x)), 16));
}

// Prefetches rows t0 .. t0 + 31 of head n of x [B, T, N, H] (row bytes `bytes`) into the cache:
// the next chunk's rows lie a head stride apart, too far for the hardware prefetcher to see.
inline void PrefetchRows(const Dims& d, const void* x, int64_t bytes, int64_t b, int64_t t0,
                         int64_t n) {
  const int64_t end = std::min(t0 + kRows, d.T);
  for (int64_t t = t0; t < end; ++t) {
    const char* row = static_cast<const char*>(x) + ((b * d.T + t) * d.N + n) * bytes;
    for (int64_t i = 0; i < bytes; i += 64) _mm_prefetch(row + i, _MM_HINT_T0);
  }
}

// The chunk's rotated q rows (and their transpose when `transpose`), zero rows from R on.
void LoadQueries(const Dims& d, const uint16_t* q, const RopeTables& rope, int64_t b,
                 int64_t t0, int64_t R, int64_t n, Work& w, bool transpose) {
  for (int64_t r = 0; r < kRows; ++r) {
    uint16_t* dst = w.qa.data() + r * w.H32;
    if (r < R) {
      RopeBf16Row(d, q + ((b * d.T + t0 + r) * d.N + n) * d.H, rope.Sin(d, b, t0 + r),
                  rope.Cos(d, b, t0 + r), w.H32, dst);
    } else {
      std::fill(dst, dst + w.H32, uint16_t{0});
    }
  }
  if (transpose) {
    for (int64_t h = 0; h < w.H32; ++h)
      for (int64_t r = 0; r < kRows; ++r) w.qt[h * kRows + r] = w.qa[r * w.H32 + h];
  }
}

// This thread's buffers, looked up once per unit (a thread_local used directly in the loops
// costs a __tls_get_addr call per access from a shared library).
__attribute__((noinline)) Work& ThreadWork() {
  thread_local Work w;
  return w;
}

// This thread's buffers for unit (b, kh), sized, with the tiles configured and the rotated
// keys packed for the scores (their rows stay in w.xb).
BA_AMX Work& StartUnit(const Dims& d, const uint16_t* k, const RopeTables& rope, int64_t b,
                       int64_t kh) {
  Work& w = ThreadWork();
  w.Resize(Up(d.S, 32), Up(d.H, 32));
  ConfigureTiles();
  LoadSlots(d, k, b, kh, &rope, w);
  PairOverH(w.xb.data(), w.S32, w.H32, w.kh.data());
  return w;
}

// chunk(n, t0, R) for the 32-row chunks (R rows, the last one shorter) of every query head
// n of kv head kh, after their rotated q rows are in w.qa (and their transpose in w.qt when
// `transpose`); the next chunk's q rows are prefetched meanwhile.
template <typename F>
void ForEachChunk(const Dims& d, const uint16_t* q, const RopeTables& rope, int64_t b,
                  int64_t kh, bool transpose, Work& w, F chunk) {
  const int64_t G = d.N / d.K;
  for (int64_t n = kh * G; n < (kh + 1) * G; ++n) {
    for (int64_t t0 = 0; t0 < d.T; t0 += kRows) {
      const int64_t R = std::min(kRows, d.T - t0);
      LoadQueries(d, q, rope, b, t0, R, n, w, transpose);
      PrefetchRows(d, q, d.H * 2, b, t0 + kRows, n);
      chunk(n, t0, R);
    }
  }
}

}  // namespace

bool AmxEnabled() {
  return ba_amx::AmxReady() && use_amx.load(std::memory_order_relaxed);
}

BA_AMX void AmxForwardUnit(const Dims& d, const uint16_t* q, const uint16_t* k,
                           const uint16_t* v, const bool* mask, const RopeTables& rope,
                           float* o, int64_t b, int64_t kh) {
  Work& w = StartUnit(d, k, rope, b, kh);
  const int64_t S32 = w.S32, H32 = w.H32;
  const float scale = 1.0f / std::sqrt(static_cast<float>(d.H));
  LoadSlots(d, v, b, kh, nullptr, w);
  PairOverRows(w.xb.data(), S32, H32, H32, w.vs.data());
  RowStats st;
  ForEachChunk(d, q, rope, b, kh, false, w, [&](int64_t n, int64_t t0, int64_t R) {
    ChunkSoftmax(d, mask + (b * d.T + t0) * d.S, R, scale, w, st);
    for (int64_t r = 0; r < kRows; ++r) {  // p rounded to bf16, zero off the blocks in use
      const float* e = w.sc.data() + r * S32;
      uint16_t* pa = w.pa.data() + r * S32;
      const __m512 inv = _mm512_set1_ps(st.inv[r]);
      for (int64_t j = 0; j < w.NB; ++j) {
        __m256i bits = _mm256_setzero_si256();
        if (w.use[j]) {
          bits = Bf16Bits(_mm512_maskz_mul_ps(PMask(d, w, st, r, j),
                                              _mm512_loadu_ps(e + 16 * j), inv));
        }
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(pa + 16 * j), bits);
      }
    }
    RowsTimesPairRows(w.pa.data(), S32, w.vs.data(), w.use32.data(), H32, w.out.data());
    for (int64_t r = 0; r < R; ++r) {
      float* dst = o + ((b * d.T + t0 + r) * d.N + n) * d.H;
      for (int64_t h = 0; h < d.H; h += 16) {
        Store16(dst + h, _mm512_loadu_ps(w.out.data() + r * H32 + h), d.H - h);
      }
    }
  });
  _tile_release();
}

BA_AMX void AmxBackwardUnit(const Dims& d, const uint16_t* q, const uint16_t* k,
                            const uint16_t* v, const bool* mask, const RopeTables& rope,
                            const float* o, const uint16_t* dout, uint16_t* dq, uint16_t* dk,
                            uint16_t* dv, int64_t b, int64_t kh) {
  Work& w = StartUnit(d, k, rope, b, kh);
  const int64_t S32 = w.S32, H32 = w.H32, NB = w.NB;
  const float scale = 1.0f / std::sqrt(static_cast<float>(d.H));
  const __m512 sv = _mm512_set1_ps(scale);
  PairOverRows(w.xb.data(), S32, H32, H32, w.ks.data());
  LoadSlots(d, v, b, kh, nullptr, w);
  PairOverH(w.xb.data(), S32, H32, w.vh.data());
  std::fill(w.dkt.begin(), w.dkt.end(), 0.0f);
  std::fill(w.dvt.begin(), w.dvt.end(), 0.0f);
  RowStats st;
  ForEachChunk(d, q, rope, b, kh, true, w, [&](int64_t n, int64_t t0, int64_t R) {
    float D[kRows];  // do . o per row
    for (int64_t r = 0; r < kRows; ++r) {
      uint16_t* g = w.ga.data() + r * H32;
      D[r] = 0.0f;
      if (r >= R) {
        std::fill(g, g + H32, uint16_t{0});
        continue;
      }
      const int64_t at = ((b * d.T + t0 + r) * d.N + n) * d.H;
      CopyBf16Row(dout + at, d.H, H32, g);
      __m512 acc = _mm512_setzero_ps();
      for (int64_t h = 0; h < d.H; h += 16) {
        acc = _mm512_fmadd_ps(Load16(g + h, d.H - h), Load16(o + at + h, d.H - h), acc);
      }
      D[r] = _mm512_reduce_add_ps(acc);
    }
    PrefetchRows(d, dout, d.H * 2, b, t0 + kRows, n);
    PrefetchRows(d, o, d.H * 4, b, t0 + kRows, n);
    for (int64_t h = 0; h < H32; ++h)
      for (int64_t r = 0; r < kRows; ++r) w.gt[h * kRows + r] = w.ga[r * H32 + h];
    ChunkSoftmax(d, mask + (b * d.T + t0) * d.S, R, scale, w, st);
    RowsTimesPairH(w.ga.data(), H32, w.vh.data(), w.live.data(), S32, w.dp.data());
    // p and ds = round(p (dp - D) / sqrt(H)) (on unmasked slots of rows that have one),
    // both rounded to bf16: ds as rows (dQ) and both paired over row pairs (dK, dV)
    for (int64_t i = 0; i < kRows / 2; ++i) {
      for (int64_t j = 0; j < NB; ++j) {
        __m512 p[2], ds[2];
        for (int x = 0; x < 2; ++x) {
          const int64_t r = 2 * i + x;
          p[x] = ds[x] = _mm512_setzero_ps();
          if (w.use[j]) {
            p[x] = _mm512_maskz_mul_ps(PMask(d, w, st, r, j),
                                       _mm512_loadu_ps(w.sc.data() + r * S32 + 16 * j),
                                       _mm512_set1_ps(st.inv[r]));
            const __mmask16 ok = st.uniform[r] ? __mmask16{0} : w.ok[r * NB + j];
            const __m512 dpr = _mm512_loadu_ps(w.dp.data() + r * S32 + 16 * j);
            ds[x] = RoundBf16(_mm512_maskz_mul_ps(
                ok, _mm512_mul_ps(p[x], _mm512_sub_ps(dpr, _mm512_set1_ps(D[r]))), sv));
            p[x] = RoundBf16(p[x]);
          }
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(w.da.data() + r * S32 + 16 * j),
                              Bf16Bits(ds[x]));
        }
        const auto pair = [](__m512 lo, __m512 hi) {
          return _mm512_or_si512(_mm512_srli_epi32(_mm512_castps_si512(lo), 16),
                                 _mm512_castps_si512(hi));
        };
        _mm512_storeu_si512(w.pp.data() + j * kTileElems + 32 * i, pair(p[0], p[1]));
        _mm512_storeu_si512(w.dsp.data() + j * kTileElems + 32 * i, pair(ds[0], ds[1]));
      }
    }
    RowsTimesPairRows(w.da.data(), S32, w.ks.data(), w.live32.data(), H32, w.out.data());
    for (int64_t r = 0; r < R; ++r) {  // back through the rotation of q
      RopeGradRow(d, w.out.data() + r * H32, rope.Sin(d, b, t0 + r), rope.Cos(d, b, t0 + r),
                  dq + ((b * d.T + t0 + r) * d.N + n) * d.H);
    }
    AddTransposed(w.gt.data(), w.pp.data(), w.use.data(), H32, S32, w.dvt.data());
    AddTransposed(w.qt.data(), w.dsp.data(), w.live.data(), H32, S32, w.dkt.data());
  });
  _tile_release();
  float* g = w.out.data();
  for (int64_t s = 0; s < d.S; ++s) {
    const int64_t at = ((b * d.S + s) * d.K + kh) * d.H;
    for (int64_t h = 0; h < d.H; ++h) g[h] = w.dkt[h * S32 + s];
    RopeGradRow(d, g, rope.Sin(d, b, s), rope.Cos(d, b, s), dk + at);
    for (int64_t h = 0; h < d.H; ++h) g[h] = w.dvt[h * S32 + s];
    StoreRow(dv + at, g, d.H);
  }
}

}  // namespace ba_attention

#endif  // BA_AVX512
