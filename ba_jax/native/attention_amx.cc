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

#include "attention.h"

extern "C" int BaAmxAvailable();  // matmul_amx.cc: AMX-BF16 present and tile state granted

namespace {
std::atomic<bool> use_amx{true};
}  // namespace

// Python's switch between this path and the AVX-512 one (tests run both).
extern "C" void BaAttentionUseAmx(int on) { use_amx.store(on != 0); }

#ifdef BA_AVX512

#define BA_AMX __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx2")))

namespace ba_attention {
namespace {

constexpr int64_t kRows = 32;   // query rows per chunk (two A tiles)
constexpr int64_t kTileElems = 512;  // bf16 elements of one 16 x 64-byte tile

inline int64_t Up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

struct alignas(64) TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

BA_AMX void ConfigureTiles() {
  TileConfig c;
  std::memset(&c, 0, sizeof c);
  c.palette_id = 1;
  for (int i = 0; i < 8; ++i) {
    c.rows[i] = 16;
    c.colsb[i] = 64;
  }
  _tile_loadconfig(&c);
}

// Per-thread buffers of one unit, kept between calls (S32, H32: S and H padded to 32).
struct Work {
  int64_t S32 = -1, H32 = -1;
  std::vector<uint16_t> xb;              // [S32, H32] bf16 rows being packed
  std::vector<uint16_t> kh, ks, vh, vs;  // packed B operands (S32 * H32 each)
  std::vector<uint16_t> qa, ga;          // the chunk's q (rotated) and do rows [32, H32]
  std::vector<uint16_t> qt, gt;          // their transposes [H32, 32]
  std::vector<float> sc, dp;             // scores -> probabilities, and dP [32, S32]
  std::vector<uint16_t> pa, da;          // probabilities and dS as bf16 rows [32, S32]
  std::vector<uint16_t> pp, dsp;         // the same paired over the 32 rows
  std::vector<float> dkt, dvt;           // dK^T, dV^T [H32, S32]
  std::vector<float> out, row;           // [32, H32], [H32]
  std::vector<uint8_t> live, live32, dvl;  // per 16-key block, per 32-key chunk, dV blocks
  void Resize(int64_t s32, int64_t h32) {
    if (s32 == S32 && h32 == H32) return;
    S32 = s32;
    H32 = h32;
    for (auto* x : {&xb, &kh, &ks, &vh, &vs}) x->assign(S32 * H32, 0);
    for (auto* x : {&qa, &ga, &qt, &gt}) x->assign(kRows * H32, 0);
    for (auto* x : {&sc, &dp}) x->assign(kRows * S32, 0.0f);
    for (auto* x : {&pa, &da, &pp, &dsp}) x->assign(kRows * S32, 0);
    for (auto* x : {&dkt, &dvt}) x->assign(H32 * S32, 0.0f);
    out.assign(kRows * H32, 0.0f);
    row.assign(H32, 0.0f);
    live.assign(S32 / 16, 0);
    dvl.assign(S32 / 16, 0);
    live32.assign(S32 / 32, 0);
  }
};

// 16 float32 lanes as bf16 bits (rounded to nearest even).
inline void StoreBf16(uint16_t* p, __m512 x) { Store16(p, x, 16); }

// Row t of x (stride `step` rows of H, bf16) as bf16 into dst [H32] (zero-padded), rotated
// first when sin/cos are given (rounded to bf16, as `qwen._rope`).
void LoadBf16Row(const Dims& d, const uint16_t* x, const float* sin, const float* cos,
                 float* row, int64_t H32, uint16_t* dst) {
  if (sin == nullptr) {
    std::memcpy(dst, x, d.H * sizeof(uint16_t));
    std::fill(dst + d.H, dst + H32, uint16_t{0});
    return;
  }
  std::fill(row, row + H32, 0.0f);
  LoadRow(d, x, row);
  Rope(d, sin, cos, true, row);
  for (int64_t h = 0; h < H32; h += 16) StoreBf16(dst + h, _mm512_loadu_ps(row + h));
}

// x[s, kh, :] of row b for s < S into w.xb [S32, H32] (keys rotated), the padding zero.
void LoadSlots(const Dims& d, const uint16_t* x, int64_t b, int64_t kh, const RopeTables* rope,
               Work& w) {
  for (int64_t s = 0; s < d.S; ++s) {
    const uint16_t* src = x + ((b * d.S + s) * d.K + kh) * d.H;
    LoadBf16Row(d, src, rope ? rope->Sin(d, b, s) : nullptr, rope ? rope->Cos(d, b, s) : nullptr,
                w.row.data(), w.H32, w.xb.data() + s * w.H32);
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

// The chunk's live 16-key blocks and each row's count of unmasked slots (rows r < R; m is
// the mask row of the chunk's first query).
void ChunkLive(const Dims& d, const bool* m, int64_t R, Work& w, int64_t* valid) {
  std::fill(w.live.begin(), w.live.end(), uint8_t{0});
  for (int64_t r = 0; r < kRows; ++r) valid[r] = 0;
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t s0 = 0; s0 < d.S; s0 += 16) {
      const __mmask16 ok = Valid16(m + r * d.S + s0, d.S - s0);
      if (ok) {
        w.live[s0 / 16] = 1;
        valid[r] += __builtin_popcount(ok);
      }
    }
  }
}

// Row sc of raw q.k products (live blocks) -> softmax probabilities of the scaled scores over
// the unmasked slots, float32, zero elsewhere; uniform over all S slots when valid == 0.
void SoftmaxRow(const Dims& d, const bool* m, const uint8_t* live, int64_t S32, int64_t valid,
                float scale, float* sc) {
  if (valid == 0) {
    for (int64_t s = 0; s < S32; ++s) sc[s] = s < d.S ? 1.0f / d.S : 0.0f;
    return;
  }
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512 sv = _mm512_set1_ps(scale);
  __m512 mx = ninf;
  for (int64_t s0 = 0; s0 < S32; s0 += 16) {
    if (!live[s0 / 16]) continue;
    const __m512 x = _mm512_mask_mov_ps(ninf, Valid16(m + s0, d.S - s0),
                                        _mm512_mul_ps(_mm512_loadu_ps(sc + s0), sv));
    _mm512_storeu_ps(sc + s0, x);
    mx = _mm512_max_ps(mx, x);
  }
  const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
  __m512 total = _mm512_setzero_ps();
  for (int64_t s0 = 0; s0 < S32; s0 += 16) {
    if (!live[s0 / 16]) {
      _mm512_storeu_ps(sc + s0, _mm512_setzero_ps());
      continue;
    }
    const __m512 e = Exp16(_mm512_sub_ps(_mm512_loadu_ps(sc + s0), top));
    _mm512_storeu_ps(sc + s0, e);
    total = _mm512_add_ps(total, e);
  }
  const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(total));
  for (int64_t s0 = 0; s0 < S32; s0 += 16) {
    if (live[s0 / 16]) _mm512_storeu_ps(sc + s0, _mm512_mul_ps(_mm512_loadu_ps(sc + s0), inv));
  }
}

// Scores and probabilities of the chunk's rows t0 .. t0 + R - 1 of head n into w.sc (rows
// >= R zero) -> whether some row is uniform. w.qa holds their rotated q.
BA_AMX bool ChunkProbabilities(const Dims& d, const bool* m, int64_t R, float scale, Work& w,
                               int64_t* valid) {
  ChunkLive(d, m, R, w, valid);
  RowsTimesPairH(w.qa.data(), w.H32, w.kh.data(), w.live.data(), w.S32, w.sc.data());
  bool uniform = false;
  for (int64_t r = 0; r < kRows; ++r) {
    float* p = w.sc.data() + r * w.S32;
    if (r < R) {
      SoftmaxRow(d, m + r * d.S, w.live.data(), w.S32, valid[r], scale, p);
      uniform |= valid[r] == 0;
    } else {
      std::fill(p, p + w.S32, 0.0f);
    }
  }
  return uniform;
}

// The chunk's rotated q rows (and their transpose when qt), zero rows from R on.
void LoadQueries(const Dims& d, const uint16_t* q, const RopeTables& rope, int64_t b,
                 int64_t t0, int64_t R, int64_t n, Work& w, bool transpose) {
  for (int64_t r = 0; r < kRows; ++r) {
    uint16_t* dst = w.qa.data() + r * w.H32;
    if (r < R) {
      LoadBf16Row(d, q + ((b * d.T + t0 + r) * d.N + n) * d.H, rope.Sin(d, b, t0 + r),
                  rope.Cos(d, b, t0 + r), w.row.data(), w.H32, dst);
    } else {
      std::fill(dst, dst + w.H32, uint16_t{0});
    }
  }
  if (transpose) {
    for (int64_t h = 0; h < w.H32; ++h)
      for (int64_t r = 0; r < kRows; ++r) w.qt[h * kRows + r] = w.qa[r * w.H32 + h];
  }
}

void RowsToBf16(const float* x, int64_t n, uint16_t* out) {
  for (int64_t i = 0; i < n; i += 16) StoreBf16(out + i, _mm512_loadu_ps(x + i));
}

void Live32(const Work& w, bool all, uint8_t* live32) {
  for (int64_t c = 0; c < w.S32 / 32; ++c) live32[c] = all || w.live[2 * c] || w.live[2 * c + 1];
}

}  // namespace

bool AmxEnabled() {
  static const bool ready = BaAmxAvailable() != 0;
  return ready && use_amx.load(std::memory_order_relaxed);
}

BA_AMX void AmxForwardUnit(const Dims& d, const uint16_t* q, const uint16_t* k,
                           const uint16_t* v, const bool* mask, const RopeTables& rope,
                           float* o, int64_t b, int64_t kh) {
  thread_local Work w;
  w.Resize(Up(d.S, 32), Up(d.H, 32));
  const float scale = 1.0f / std::sqrt(static_cast<float>(d.H));
  ConfigureTiles();
  LoadSlots(d, k, b, kh, &rope, w);
  PairOverH(w.xb.data(), w.S32, w.H32, w.kh.data());
  LoadSlots(d, v, b, kh, nullptr, w);
  PairOverRows(w.xb.data(), w.S32, w.H32, w.H32, w.vs.data());
  int64_t valid[kRows];
  const int64_t G = d.N / d.K;
  for (int64_t n = kh * G; n < (kh + 1) * G; ++n) {
    for (int64_t t0 = 0; t0 < d.T; t0 += kRows) {
      const int64_t R = std::min(kRows, d.T - t0);
      const bool* m = mask + (b * d.T + t0) * d.S;
      LoadQueries(d, q, rope, b, t0, R, n, w, false);
      const bool uniform = ChunkProbabilities(d, m, R, scale, w, valid);
      RowsToBf16(w.sc.data(), kRows * w.S32, w.pa.data());
      Live32(w, uniform, w.live32.data());
      RowsTimesPairRows(w.pa.data(), w.S32, w.vs.data(), w.live32.data(), w.H32, w.out.data());
      for (int64_t r = 0; r < R; ++r) {
        std::memcpy(o + ((b * d.T + t0 + r) * d.N + n) * d.H, w.out.data() + r * w.H32,
                    d.H * sizeof(float));
      }
    }
  }
  _tile_release();
}

BA_AMX void AmxBackwardUnit(const Dims& d, const uint16_t* q, const uint16_t* k,
                            const uint16_t* v, const bool* mask, const RopeTables& rope,
                            const float* o, const uint16_t* dout, float* dq, float* dk,
                            float* dv, int64_t b, int64_t kh) {
  thread_local Work w;
  w.Resize(Up(d.S, 32), Up(d.H, 32));
  const int64_t S32 = w.S32, H32 = w.H32;
  const float scale = 1.0f / std::sqrt(static_cast<float>(d.H));
  const __m512 sv = _mm512_set1_ps(scale);
  ConfigureTiles();
  LoadSlots(d, k, b, kh, &rope, w);
  PairOverH(w.xb.data(), S32, H32, w.kh.data());
  PairOverRows(w.xb.data(), S32, H32, H32, w.ks.data());
  LoadSlots(d, v, b, kh, nullptr, w);
  PairOverH(w.xb.data(), S32, H32, w.vh.data());
  std::fill(w.dkt.begin(), w.dkt.end(), 0.0f);
  std::fill(w.dvt.begin(), w.dvt.end(), 0.0f);
  int64_t valid[kRows];
  const int64_t G = d.N / d.K;
  for (int64_t n = kh * G; n < (kh + 1) * G; ++n) {
    for (int64_t t0 = 0; t0 < d.T; t0 += kRows) {
      const int64_t R = std::min(kRows, d.T - t0);
      const bool* m = mask + (b * d.T + t0) * d.S;
      LoadQueries(d, q, rope, b, t0, R, n, w, true);
      float D[kRows];
      for (int64_t r = 0; r < kRows; ++r) {
        uint16_t* dst = w.ga.data() + r * H32;
        D[r] = 0.0f;
        if (r < R) {
          const int64_t at = ((b * d.T + t0 + r) * d.N + n) * d.H;
          LoadBf16Row(d, dout + at, nullptr, nullptr, nullptr, H32, dst);
          const __m512 dot = [&] {
            __m512 acc = _mm512_setzero_ps();
            for (int64_t h = 0; h < d.H; h += 16) {
              acc = _mm512_fmadd_ps(Load16(dst + h, d.H - h), Load16(o + at + h, d.H - h), acc);
            }
            return acc;
          }();
          D[r] = _mm512_reduce_add_ps(dot);
        } else {
          std::fill(dst, dst + H32, uint16_t{0});
        }
      }
      for (int64_t h = 0; h < H32; ++h)
        for (int64_t r = 0; r < kRows; ++r) w.gt[h * kRows + r] = w.ga[r * H32 + h];
      const bool uniform = ChunkProbabilities(d, m, R, scale, w, valid);
      RowsTimesPairH(w.ga.data(), H32, w.vh.data(), w.live.data(), S32, w.dp.data());
      // ds = round(p (dp - D) / sqrt(H)) on unmasked slots of rows with one; 0 elsewhere
      for (int64_t r = 0; r < kRows; ++r) {
        const float* p = w.sc.data() + r * S32;
        const float* dpr = w.dp.data() + r * S32;
        uint16_t* ds = w.da.data() + r * S32;
        const __m512 Dr = _mm512_set1_ps(D[r]);
        for (int64_t s0 = 0; s0 < S32; s0 += 16) {
          __mmask16 ok = 0;
          if (r < R && valid[r] > 0 && w.live[s0 / 16]) ok = Valid16(m + r * d.S + s0, d.S - s0);
          const __m512 x = _mm512_mul_ps(
              _mm512_mul_ps(_mm512_loadu_ps(p + s0), _mm512_sub_ps(_mm512_loadu_ps(dpr + s0), Dr)),
              sv);
          StoreBf16(ds + s0, _mm512_maskz_mov_ps(ok, x));
        }
      }
      RowsToBf16(w.sc.data(), kRows * S32, w.pa.data());
      PairOverRows(w.pa.data(), kRows, S32, S32, w.pp.data());
      PairOverRows(w.da.data(), kRows, S32, S32, w.dsp.data());
      Live32(w, false, w.live32.data());
      RowsTimesPairRows(w.da.data(), S32, w.ks.data(), w.live32.data(), H32, w.out.data());
      for (int64_t r = 0; r < R; ++r) {  // back through the rotation of q
        float* g = w.out.data() + r * H32;
        RopeGrad(d, rope.Sin(d, b, t0 + r), rope.Cos(d, b, t0 + r), true, g);
        std::memcpy(dq + ((b * d.T + t0 + r) * d.N + n) * d.H, g, d.H * sizeof(float));
      }
      for (int64_t j = 0; j < S32 / 16; ++j) w.dvl[j] = uniform || w.live[j];
      AddTransposed(w.gt.data(), w.pp.data(), w.dvl.data(), H32, S32, w.dvt.data());
      AddTransposed(w.qt.data(), w.dsp.data(), w.live.data(), H32, S32, w.dkt.data());
    }
  }
  _tile_release();
  float* g = w.row.data();
  for (int64_t s = 0; s < d.S; ++s) {
    const int64_t at = ((b * d.S + s) * d.K + kh) * d.H;
    for (int64_t h = 0; h < d.H; ++h) g[h] = w.dkt[h * S32 + s];
    RopeGrad(d, rope.Sin(d, b, s), rope.Cos(d, b, s), true, g);
    std::memcpy(dk + at, g, d.H * sizeof(float));
    for (int64_t h = 0; h < d.H; ++h) dv[at + h] = w.dvt[h * S32 + s];
  }
}

}  // namespace ba_attention

#endif  // BA_AVX512
