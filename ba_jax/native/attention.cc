// Masked self-attention for training on the CPU (forward and backward), as XLA FFI calls.
//
// Why it exists: XLA:CPU materialises every [B, K, G, T, S] intermediate of attention (scores,
// the mask select, softmax, probabilities in the compute dtype, and in the backward their
// gradients), each a pass over memory, and a causal mask still computes the masked half.
// Here one (row, kv head) at a time keeps its keys and values in cache as float32, computes
// scores only for 16-slot blocks that hold an unmasked slot, and never writes a [T, S] array.
//
// Numerics follow `qwen._attend` and `qwen._self_attention`'s backward: products and sums in
// float32, scores scaled by 1/sqrt(H), softmax in float32 (exp by the Cephes polynomial of
// simd.h), probabilities rounded to the compute dtype before the value sum; a query row with
// no unmasked slot gets uniform probabilities over all S slots (what the XLA path's finite
// -1e30 mask gives). The backward recomputes the probabilities exactly as the forward does:
//   dv_s += round(p_s) do,  dp_s = do . v_s,  D = do . o,  ds_s = round(p_s (dp_s - D) / sqrt(H))
//   on unmasked slots (0 elsewhere),  dq = sum_s ds_s k_s,  dk_s += ds_s q
// (round: to the compute dtype when it is bfloat16; identity in float32).
//
// Operands (B rows, T queries, S = T keys, N query heads, K kv heads, H head dim, D = f32 or
// bf16; query head n uses kv head n / (N / K)):
//   q [B, T, N, H] D, k [B, S, K, H] D, v [B, S, K, H] D, mask [B, T, S] pred,
//   sin, cos [B, T, H] f32 (S == T): q and k enter before their rotary embedding, which the
//   kernel applies on load (rounded to D, as `qwen._rope`), so XLA does not recompute the
//   sin/cos tables for every head (it fuses them into each RoPE)
//   forward  -> o [B, T, N, H] f32
//   backward (q, k, v, mask, sin, cos, o f32, do D) -> dq [B, T, N, H], dk, dv [B, S, K, H],
//   in D (float32 sums rounded once) and with respect to the un-rotated q and k
// Work is split by (row, kv head) over the calling thread and XLA's intra-op pool.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>

#include "attention.h"
#include "buffers.h"
#include "parallel.h"
#include "simd.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

#ifdef BA_AVX512

using namespace ba_attention;

// Query rows are processed kR at a time (consecutive positions of one head): each key or
// value vector loaded serves all kR rows, and the dk/dv rows are read and written once per
// kR query rows instead of once per row.
constexpr int kR = 4;

// Per-thread float32 copies of one (row, kv head)'s keys and values, zero-padded; kept
// between calls (the padding stays zero: units only write the first S x H).
struct Scratch {
  std::vector<float> kt, vt, kf, vf, dk, dv, sc, p, ds, row;
  std::vector<uint8_t> live;
  int64_t Sp = -1, Hp = -1;
  void Resize(const Dims& d) {
    if (d.Sp == Sp && d.Hp == Hp) return;
    Sp = d.Sp;
    Hp = d.Hp;
    const int64_t n = d.Sp * d.Hp;
    for (auto* x : {&kt, &vt, &kf, &vf, &dk, &dv}) x->assign(n, 0.0f);
    for (auto* x : {&sc, &p, &ds}) x->assign(kR * d.Sp, 0.0f);
    row.assign(3 * kR * d.Hp, 0.0f);
    live.assign(d.Sp / 16, 0);
  }
};

// Rotary embedding of one float32 row in place, with its position's sin/cos rows (HF
// rotate-half: the two halves of H form the pairs), rounded to bf16 when the operands are.
void Rope(const Dims& d, const float* sin, const float* cos, bool bf16, float* x) {
  const int64_t half = d.H / 2;
  alignas(64) float y[512];
  for (int64_t h = 0; h < half; ++h) y[h] = x[h] * cos[h] - x[h + half] * sin[h];
  for (int64_t h = half; h < d.H; ++h) y[h] = x[h] * cos[h] + x[h - half] * sin[h];
  std::memcpy(x, y, d.H * sizeof(float));
  if (bf16) {
    for (int64_t h = 0; h < d.H; h += 16) {
      _mm512_mask_storeu_ps(x + h, Lanes(d.H - h), RoundBf16(_mm512_loadu_ps(x + h)));
    }
  }
}

// The transpose of Rope (its gradient): dx1 = dy1 cos + dy2 sin, dx2 = dy2 cos - dy1 sin.
// With bf16 operands g is rounded to bf16 first, as the XLA path's rotated-q/k gradient is.
void RopeGrad(const Dims& d, const float* sin, const float* cos, bool bf16, float* g) {
  if (bf16) {
    for (int64_t h = 0; h < d.H; h += 16) {
      _mm512_mask_storeu_ps(g + h, Lanes(d.H - h), RoundBf16(_mm512_loadu_ps(g + h)));
    }
  }
  const int64_t half = d.H / 2;
  alignas(64) float y[512];
  for (int64_t h = 0; h < half; ++h) y[h] = g[h] * cos[h] + g[h + half] * sin[h + half];
  for (int64_t h = half; h < d.H; ++h) y[h] = g[h] * cos[h] - g[h - half] * sin[h - half];
  std::memcpy(g, y, d.H * sizeof(float));
}

template <typename T>
void LoadRow(const Dims& d, const T* x, float* out) {
  for (int64_t h = 0; h < d.H; h += 16) _mm512_storeu_ps(out + h, Load16(x + h, d.H - h));
}

// x[s, kh, :] of one row as float32 into a [Sp, Hp] copy and (when xt) an [Hp, Sp] one;
// rotated first when rope is given (the keys).
template <typename T>
void LoadSlots(const Dims& d, const T* x, int64_t b, int64_t kh, float* xf, float* xt,
               const RopeTables* rope = nullptr) {
  constexpr bool kBf16 = std::is_same<T, uint16_t>::value;
  for (int64_t s = 0; s < d.S; ++s) {
    const T* src = x + ((b * d.S + s) * d.K + kh) * d.H;
    for (int64_t h = 0; h < d.H; h += 16) {
      _mm512_storeu_ps(xf + s * d.Hp + h, Load16(src + h, d.H - h));
    }
    if (rope != nullptr) Rope(d, rope->Sin(d, b, s), rope->Cos(d, b, s), kBf16, xf + s * d.Hp);
    if (xt != nullptr) {
      for (int64_t h = 0; h < d.H; ++h) xt[h * d.Sp + s] = xf[s * d.Hp + h];
    }
  }
}

// For kR rows of one head: sc[r][s] = (q_r . k_s) * scale on row r's unmasked slots, -inf
// elsewhere; rows r >= R get no slot. live[s / 16]: the block holds an unmasked slot of some
// row (other blocks are skipped). valid[r]: row r's unmasked slots.
void Scores(const Dims& d, const float* q, const float* kt, const bool* m, int R, float scale,
            float* sc, uint8_t* live, int64_t* valid) {
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int r = 0; r < kR; ++r) valid[r] = 0;
  for (int64_t s0 = 0; s0 < d.S; s0 += 16) {
    __mmask16 ok[kR];
    bool any = false;
    for (int r = 0; r < kR; ++r) {
      ok[r] = r < R ? Valid16(m + r * d.S + s0, d.S - s0) : 0;
      any |= ok[r] != 0;
    }
    live[s0 / 16] = any;
    if (!any) {
      for (int r = 0; r < kR; ++r) _mm512_storeu_ps(sc + r * d.Sp + s0, ninf);
      continue;
    }
    __m512 acc[kR];
    for (int r = 0; r < kR; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t h = 0; h < d.H; ++h) {
      const __m512 kv = _mm512_loadu_ps(kt + h * d.Sp + s0);
      for (int r = 0; r < kR; ++r) {
        acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(q[r * d.Hp + h]), kv, acc[r]);
      }
    }
    for (int r = 0; r < kR; ++r) {
      const __m512 x = _mm512_mul_ps(acc[r], _mm512_set1_ps(scale));
      _mm512_storeu_ps(sc + r * d.Sp + s0, _mm512_mask_mov_ps(ninf, ok[r], x));
      valid[r] += __builtin_popcount(ok[r]);
    }
  }
}

// p = softmax(sc) over the S slots (uniform when no slot is unmasked), float32.
void Softmax(const Dims& d, const float* sc, int64_t valid, const uint8_t* live, float* p) {
  if (valid == 0) {
    for (int64_t s = 0; s < d.Sp; ++s) p[s] = s < d.S ? 1.0f / d.S : 0.0f;
    return;
  }
  __m512 mx = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t s0 = 0; s0 < d.S; s0 += 16) {
    if (live[s0 / 16]) mx = _mm512_max_ps(mx, _mm512_maskz_loadu_ps(Lanes(d.S - s0), sc + s0));
  }
  const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
  __m512 total = _mm512_setzero_ps();
  for (int64_t s0 = 0; s0 < d.Sp; s0 += 16) {  // masked (-inf) and padding lanes give 0
    if (!live[s0 / 16]) {
      _mm512_storeu_ps(p + s0, _mm512_setzero_ps());
      continue;
    }
    const __m512 x = _mm512_sub_ps(_mm512_loadu_ps(sc + s0), m);
    const __m512 e = _mm512_maskz_mov_ps(Lanes(d.S - s0), Exp16(x));
    _mm512_storeu_ps(p + s0, e);
    total = _mm512_add_ps(total, e);
  }
  const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(total));
  for (int64_t s0 = 0; s0 < d.Sp; s0 += 16) {
    if (live[s0 / 16]) _mm512_storeu_ps(p + s0, _mm512_mul_ps(_mm512_loadu_ps(p + s0), inv));
  }
}

// out[r][:] = sum_s w[r][s] * x[s, :] for kR rows (x is [Sp, Hp]), over the live blocks
// (all blocks when `all`).
void WeightedRows(const Dims& d, const float* w, const float* x, const uint8_t* live, bool all,
                  float* out) {
  for (int64_t h0 = 0; h0 < d.Hp; h0 += 64) {
    __m512 a[kR][4];
    for (int r = 0; r < kR; ++r)
      for (int j = 0; j < 4; ++j) a[r][j] = _mm512_setzero_ps();
    for (int64_t s0 = 0; s0 < d.S; s0 += 16) {
      if (!all && !live[s0 / 16]) continue;
      for (int64_t s = s0; s < std::min(s0 + 16, d.S); ++s) {
        __m512 v[4];
        for (int j = 0; j < 4; ++j) v[j] = _mm512_loadu_ps(x + s * d.Hp + h0 + 16 * j);
        for (int r = 0; r < kR; ++r) {
          const __m512 ws = _mm512_set1_ps(w[r * d.Sp + s]);
          for (int j = 0; j < 4; ++j) a[r][j] = _mm512_fmadd_ps(ws, v[j], a[r][j]);
        }
      }
    }
    for (int r = 0; r < kR; ++r)
      for (int j = 0; j < 4; ++j) _mm512_storeu_ps(out + r * d.Hp + h0 + 16 * j, a[r][j]);
  }
}

// x[s, :] += sum_r w[r][s] * y[r][:] over the live blocks (all blocks when `all`).
void AddOuter(const Dims& d, const float* w, const float* y, const uint8_t* live, bool all,
              float* x) {
  for (int64_t h0 = 0; h0 < d.Hp; h0 += 64) {
    __m512 yr[kR][4];
    for (int r = 0; r < kR; ++r)
      for (int j = 0; j < 4; ++j) yr[r][j] = _mm512_loadu_ps(y + r * d.Hp + h0 + 16 * j);
    for (int64_t s0 = 0; s0 < d.S; s0 += 16) {
      if (!all && !live[s0 / 16]) continue;
      for (int64_t s = s0; s < std::min(s0 + 16, d.S); ++s) {
        float* dst = x + s * d.Hp + h0;
        __m512 acc[4];
        for (int j = 0; j < 4; ++j) acc[j] = _mm512_loadu_ps(dst + 16 * j);
        for (int r = 0; r < kR; ++r) {
          const __m512 ws = _mm512_set1_ps(w[r * d.Sp + s]);
          for (int j = 0; j < 4; ++j) acc[j] = _mm512_fmadd_ps(ws, yr[r][j], acc[j]);
        }
        for (int j = 0; j < 4; ++j) _mm512_storeu_ps(dst + 16 * j, acc[j]);
      }
    }
  }
}

void RoundAll(float* x, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) _mm512_storeu_ps(x + i, RoundBf16(_mm512_loadu_ps(x + i)));
}

// Rows t0 .. t0 + R - 1 of query head n (R <= kR) as float32 [kR, Hp]; the others zero.
template <typename T>
void LoadRows(const Dims& d, const T* x, int64_t b, int64_t t0, int R, int64_t n, float* out,
              const RopeTables* rope = nullptr) {
  constexpr bool kBf16 = std::is_same<T, uint16_t>::value;
  for (int r = 0; r < kR; ++r) {
    if (r < R) {
      LoadRow(d, x + ((b * d.T + t0 + r) * d.N + n) * d.H, out + r * d.Hp);
      if (rope != nullptr) {
        Rope(d, rope->Sin(d, b, t0 + r), rope->Cos(d, b, t0 + r), kBf16, out + r * d.Hp);
      }
    } else {
      std::fill(out + r * d.Hp, out + (r + 1) * d.Hp, 0.0f);
    }
  }
}

// Softmax of the block's rows (rows >= R: zero) -> whether some row is uniform (all slots).
bool BlockSoftmax(const Dims& d, Scratch& w, int R, const int64_t* valid) {
  bool uniform = false;
  for (int r = 0; r < kR; ++r) {
    float* p = w.p.data() + r * d.Sp;
    if (r < R) {
      Softmax(d, w.sc.data() + r * d.Sp, valid[r], w.live.data(), p);
      uniform |= valid[r] == 0;
    } else {
      std::fill(p, p + d.Sp, 0.0f);
    }
  }
  return uniform;
}

template <typename T>
void ForwardUnit(const Dims& d, const T* q, const T* k, const T* v, const bool* mask,
                 const RopeTables& rope, float* o, int64_t b, int64_t kh, Scratch& w) {
  constexpr bool kBf16 = std::is_same<T, uint16_t>::value;
  const float scale = 1.0f / std::sqrt(static_cast<float>(d.H));
  LoadSlots(d, k, b, kh, w.kf.data(), w.kt.data(), &rope);
  LoadSlots(d, v, b, kh, w.vf.data(), static_cast<float*>(nullptr));
  const int64_t G = d.N / d.K;
  float* qf = w.row.data();
  float* out = qf + kR * d.Hp;
  int64_t valid[kR];
  for (int64_t n = kh * G; n < (kh + 1) * G; ++n) {
    for (int64_t t0 = 0; t0 < d.T; t0 += kR) {
      const int R = static_cast<int>(std::min<int64_t>(kR, d.T - t0));
      LoadRows(d, q, b, t0, R, n, qf, &rope);
      Scores(d, qf, w.kt.data(), mask + (b * d.T + t0) * d.S, R, scale, w.sc.data(),
             w.live.data(), valid);
      const bool uniform = BlockSoftmax(d, w, R, valid);
      if (kBf16) RoundAll(w.p.data(), kR * d.Sp);
      WeightedRows(d, w.p.data(), w.vf.data(), w.live.data(), uniform, out);
      for (int r = 0; r < R; ++r) {
        std::memcpy(o + ((b * d.T + t0 + r) * d.N + n) * d.H, out + r * d.Hp,
                    d.H * sizeof(float));
      }
    }
  }
}

template <typename T>
void BackwardUnit(const Dims& d, const T* q, const T* k, const T* v, const bool* mask,
                  const RopeTables& rope, const float* o, const T* dout, T* dq, T* dk, T* dv,
                  int64_t b, int64_t kh, Scratch& w) {
  constexpr bool kBf16 = std::is_same<T, uint16_t>::value;
  const float scale = 1.0f / std::sqrt(static_cast<float>(d.H));
  LoadSlots(d, k, b, kh, w.kf.data(), w.kt.data(), &rope);
  LoadSlots(d, v, b, kh, w.vf.data(), w.vt.data());
  std::fill(w.dk.begin(), w.dk.end(), 0.0f);
  std::fill(w.dv.begin(), w.dv.end(), 0.0f);
  const int64_t G = d.N / d.K;
  float* qf = w.row.data();
  float* dof = qf + kR * d.Hp;
  float* dqf = dof + kR * d.Hp;
  int64_t valid[kR];
  const __m512 sv = _mm512_set1_ps(scale);
  for (int64_t n = kh * G; n < (kh + 1) * G; ++n) {
    for (int64_t t0 = 0; t0 < d.T; t0 += kR) {
      const int R = static_cast<int>(std::min<int64_t>(kR, d.T - t0));
      const bool* m = mask + (b * d.T + t0) * d.S;
      LoadRows(d, q, b, t0, R, n, qf, &rope);
      LoadRows(d, dout, b, t0, R, n, dof);
      Scores(d, qf, w.kt.data(), m, R, scale, w.sc.data(), w.live.data(), valid);
      const bool uniform = BlockSoftmax(d, w, R, valid);
      // ds = p (dp - D) / sqrt(H) on unmasked slots, dp_s = do . v_s, D = do . o
      __m512 D[kR];
      for (int r = 0; r < kR; ++r) {
        float x = 0.0f;
        if (r < R && valid[r] > 0) {
          const float* orow = o + ((b * d.T + t0 + r) * d.N + n) * d.H;
          for (int64_t h = 0; h < d.H; ++h) x += dof[r * d.Hp + h] * orow[h];
        }
        D[r] = _mm512_set1_ps(x);
      }
      float* ds = w.ds.data();
      for (int64_t s0 = 0; s0 < d.Sp; s0 += 16) {
        if (!w.live[s0 / 16]) {
          for (int r = 0; r < kR; ++r) _mm512_storeu_ps(ds + r * d.Sp + s0, _mm512_setzero_ps());
          continue;
        }
        __m512 acc[kR];
        for (int r = 0; r < kR; ++r) acc[r] = _mm512_setzero_ps();
        for (int64_t h = 0; h < d.H; ++h) {
          const __m512 vv = _mm512_loadu_ps(w.vt.data() + h * d.Sp + s0);
          for (int r = 0; r < kR; ++r) {
            acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(dof[r * d.Hp + h]), vv, acc[r]);
          }
        }
        for (int r = 0; r < kR; ++r) {
          const __mmask16 ok =
              r < R && valid[r] > 0 ? Valid16(m + r * d.S + s0, d.S - s0) : __mmask16{0};
          const __m512 p = _mm512_loadu_ps(w.p.data() + r * d.Sp + s0);
          __m512 x = _mm512_mul_ps(_mm512_mul_ps(p, _mm512_sub_ps(acc[r], D[r])), sv);
          if (kBf16) x = RoundBf16(x);
          _mm512_storeu_ps(ds + r * d.Sp + s0, _mm512_maskz_mov_ps(ok, x));
        }
      }
      if (kBf16) RoundAll(w.p.data(), kR * d.Sp);
      AddOuter(d, w.p.data(), dof, w.live.data(), uniform, w.dv.data());
      AddOuter(d, ds, qf, w.live.data(), false, w.dk.data());
      WeightedRows(d, ds, w.kf.data(), w.live.data(), false, dqf);
      for (int r = 0; r < R; ++r) {  // back through the rotation of q
        RopeGrad(d, rope.Sin(d, b, t0 + r), rope.Cos(d, b, t0 + r), kBf16, dqf + r * d.Hp);
        StoreRow(dq + ((b * d.T + t0 + r) * d.N + n) * d.H, dqf + r * d.Hp, d.H);
      }
    }
  }
  for (int64_t s = 0; s < d.S; ++s) {
    const int64_t at = ((b * d.S + s) * d.K + kh) * d.H;
    RopeGrad(d, rope.Sin(d, b, s), rope.Cos(d, b, s), kBf16, w.dk.data() + s * d.Hp);
    StoreRow(dk + at, w.dk.data() + s * d.Hp, d.H);
    StoreRow(dv + at, w.dv.data() + s * d.Hp, d.H);
  }
}

// Runs unit(b, kh, scratch) for every (row, kv head) over the caller and the pool.
template <typename F>
void ForEachUnit(ffi::ThreadPool& pool, const Dims& d, F unit) {
  ba_native::ParallelFor(pool, d.B * d.K, [=](int64_t i) {
    thread_local Scratch w;
    w.Resize(d);
    unit(i / d.K, i % d.K, w);
  });
}

using ba_native::In;
using ba_native::Out;

ffi::Error Check(const ffi::AnyBuffer& q, const ffi::AnyBuffer& k, const ffi::AnyBuffer& v,
                 const ffi::Buffer<ffi::PRED>& mask, Dims& d) {
  const auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions(),
             md = mask.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || vd.size() != 4 || md.size() != 3) {
    return ffi::Error::InvalidArgument(
        "attention: q must be [B,T,N,H], k and v [B,S,K,H], mask [B,T,S]");
  }
  d = Dims{qd[0], qd[1], kd[1], qd[2], kd[2], qd[3], 0, 0};
  d.Sp = (d.S + 15) / 16 * 16;
  d.Hp = (d.H + 63) / 64 * 64;
  if (kd[0] != d.B || kd[3] != d.H || vd[0] != d.B || vd[1] != d.S || vd[2] != d.K ||
      vd[3] != d.H || md[0] != d.B || md[1] != d.T || md[2] != d.S || d.K == 0 ||
      d.N % d.K != 0 || k.element_type() != q.element_type() ||
      v.element_type() != q.element_type()) {
    return ffi::Error::InvalidArgument("attention: inconsistent shapes or dtypes");
  }
  if (q.element_type() != ffi::F32 && q.element_type() != ffi::BF16) {
    return ffi::Error::InvalidArgument("attention: dtype must be f32 or bf16");
  }
  return ffi::Error::Success();
}

// sin/cos [B, T, H] float32, H even, and S == T (self-attention: keys at query positions).
ffi::Error CheckRope(const Dims& d, const ffi::Buffer<ffi::F32>& sin,
                     const ffi::Buffer<ffi::F32>& cos, RopeTables& rope) {
  const auto sd = sin.dimensions(), cd = cos.dimensions();
  if (sd.size() != 3 || cd.size() != 3 || sd[0] != d.B || sd[1] != d.T || sd[2] != d.H ||
      cd[0] != d.B || cd[1] != d.T || cd[2] != d.H || d.S != d.T || d.H % 2 || d.H > 512) {
    return ffi::Error::InvalidArgument(
        "attention: sin and cos must be [B,T,H] (H even, at most 512) and S == T");
  }
  rope = RopeTables{sin.typed_data(), cos.typed_data()};
  return ffi::Error::Success();
}

ffi::Error Forward(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                   ffi::Buffer<ffi::PRED> mask, ffi::Buffer<ffi::F32> sin,
                   ffi::Buffer<ffi::F32> cos, ffi::Result<ffi::Buffer<ffi::F32>> o) {
  Dims d;
  if (auto err = Check(q, k, v, mask, d); err.failure()) return err;
  RopeTables rope;
  if (auto err = CheckRope(d, sin, cos, rope); err.failure()) return err;
  const bool* m = mask.typed_data();
  float* out = o->typed_data();
  auto run = [&](auto tag) {
    using T = decltype(tag);
    const T *qp = In<T>(q), *kp = In<T>(k), *vp = In<T>(v);
    ForEachUnit(pool, d, [=](int64_t b, int64_t kh, Scratch& w) {
      ForwardUnit(d, qp, kp, vp, m, rope, out, b, kh, w);
    });
  };
  if (q.element_type() == ffi::F32) {
    run(float{});
  } else if (AmxEnabled()) {
    const auto *qp = In<uint16_t>(q), *kp = In<uint16_t>(k), *vp = In<uint16_t>(v);
    ba_native::ParallelFor(pool, d.B * d.K, [=](int64_t i) {
      AmxForwardUnit(d, qp, kp, vp, m, rope, out, i / d.K, i % d.K);
    });
  } else {
    run(uint16_t{});
  }
  return ffi::Error::Success();
}

ffi::Error Backward(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                    ffi::Buffer<ffi::PRED> mask, ffi::Buffer<ffi::F32> sin,
                    ffi::Buffer<ffi::F32> cos, ffi::Buffer<ffi::F32> o, ffi::AnyBuffer dout,
                    ffi::Result<ffi::AnyBuffer> dq, ffi::Result<ffi::AnyBuffer> dk,
                    ffi::Result<ffi::AnyBuffer> dv) {
  Dims d;
  if (auto err = Check(q, k, v, mask, d); err.failure()) return err;
  RopeTables rope;
  if (auto err = CheckRope(d, sin, cos, rope); err.failure()) return err;
  if (dout.element_type() != q.element_type() || o.element_count() != q.element_count() ||
      dout.element_count() != q.element_count()) {
    return ffi::Error::InvalidArgument("attention backward: o and do must match q");
  }
  if (dq->element_type() != q.element_type() || dk->element_type() != q.element_type() ||
      dv->element_type() != q.element_type()) {
    return ffi::Error::InvalidArgument("attention backward: gradients in q's dtype");
  }
  const bool* m = mask.typed_data();
  const float* op = o.typed_data();
  auto run = [&](auto tag) {
    using T = decltype(tag);
    const T *qp = In<T>(q), *kp = In<T>(k), *vp = In<T>(v), *gp = In<T>(dout);
    T *dqp = Out<T>(dq), *dkp = Out<T>(dk), *dvp = Out<T>(dv);
    ForEachUnit(pool, d, [=](int64_t b, int64_t kh, Scratch& w) {
      BackwardUnit(d, qp, kp, vp, m, rope, op, gp, dqp, dkp, dvp, b, kh, w);
    });
  };
  if (q.element_type() == ffi::F32) {
    run(float{});
  } else if (AmxEnabled()) {
    const auto *qp = In<uint16_t>(q), *kp = In<uint16_t>(k), *vp = In<uint16_t>(v),
               *gp = In<uint16_t>(dout);
    auto *dqp = Out<uint16_t>(dq), *dkp = Out<uint16_t>(dk), *dvp = Out<uint16_t>(dv);
    ba_native::ParallelFor(pool, d.B * d.K, [=](int64_t i) {
      AmxBackwardUnit(d, qp, kp, vp, m, rope, op, gp, dqp, dkp, dvp, i / d.K, i % d.K);
    });
  } else {
    run(uint16_t{});
  }
  return ffi::Error::Success();
}

#else  // no AVX-512: Python keeps XLA's attention (BaAttentionAvailable() == 0)

ffi::Error Forward(ffi::ThreadPool, ffi::AnyBuffer, ffi::AnyBuffer, ffi::AnyBuffer,
                   ffi::Buffer<ffi::PRED>, ffi::Buffer<ffi::F32>, ffi::Buffer<ffi::F32>,
                   ffi::Result<ffi::Buffer<ffi::F32>>) {
  return ffi::Error::InvalidArgument("attention kernel built without AVX-512");
}

ffi::Error Backward(ffi::ThreadPool, ffi::AnyBuffer, ffi::AnyBuffer, ffi::AnyBuffer,
                    ffi::Buffer<ffi::PRED>, ffi::Buffer<ffi::F32>, ffi::Buffer<ffi::F32>,
                    ffi::Buffer<ffi::F32>, ffi::AnyBuffer, ffi::Result<ffi::AnyBuffer>,
                    ffi::Result<ffi::AnyBuffer>, ffi::Result<ffi::AnyBuffer>) {
  return ffi::Error::InvalidArgument("attention kernel built without AVX-512");
}

#endif

}  // namespace

extern "C" int BaAttentionAvailable() {
#ifdef BA_AVX512
  return 1;
#else
  return 0;
#endif
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(BaAttentionForward, Forward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(BaAttentionBackward, Backward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());
