// One-token cached attention for CPU decoding, as an XLA FFI custom call.
//
// Why it exists: on XLA:CPU the decode step's attention is a batched matrix-vector product
// per (row, kv head) that the generic dot kernels run at a few GFLOP/s, and a bfloat16
// dynamic_update_slice of the cache is rewritten through float32 (the whole cache, every
// step). This kernel writes the new key/value into the cache in place (the cache buffers
// are aliased input -> output) and attends over slots 0..index only, reading each key and
// value once for all query heads of its kv group. Keys are stored transposed ([H, S] per
// row and kv head) so that 16 slots' scores are one vector of fused multiply-adds, with no
// horizontal sums. Numerics follow `qwen.Attention`: products and sums in float32, softmax
// in float32 (exp by a Cephes polynomial, ~1 ulp), probabilities rounded to the cache dtype
// before the value sum when that dtype is bfloat16.
//
// Operands (B rows, N query heads, K kv heads, S slots, H head dim; D = f32 or bf16):
//   q [B, N, H] D (after RoPE), k_new [B, K, H] D (after RoPE), v_new [B, K, H] D,
//   k_cache [B, K, H, S] D (keys transposed), v_cache [B, K, S, H] D, mask [B, S] s32,
//   index [] s32
// Results: out [B, N, H] f32, k_cache, v_cache (aliased to the operands).
// Slot s of row b is attended iff mask[b, s] != 0 and s <= index; the new key/value are
// written to slot `index` first. A row with no attended slot averages all S slots
// uniformly (the -1e30 masking of the XLA path gives the same).
//
// BaDecodeAttentionShared takes three more operands, a prompt segment shared by groups of
// rows: k_prompt [P, K, H, Tp] D, v_prompt [P, K, Tp, H] D, prompt_mask [P, Tp] s32, with
// B = P * G' (rows b of one prompt are contiguous: prompt b / G'). Row b attends over its
// prompt's unmasked slots followed by its own cache slots as above: the softmax runs over
// both segments at once, as over one cache of Tp + S slots (the uniform fallback too). The
// G' samples of a prompt read one copy of its keys and values instead of G'.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "parallel.h"
#include "simd.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

inline float Bf16ToF32(uint16_t x) {
  uint32_t u = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline float RoundToBf16(float f) {  // round to nearest even, as XLA's convert does
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return f;  // NaN stays NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  u &= 0xffff0000u;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

template <typename T>
inline float Load(const T* p, int64_t i);
template <>
inline float Load<float>(const float* p, int64_t i) { return p[i]; }
template <>
inline float Load<uint16_t>(const uint16_t* p, int64_t i) { return Bf16ToF32(p[i]); }

struct Dims {
  int64_t B, N, K, S, H;
};

#ifdef BA_AVX512

// sc[g, s] = sum_h q[g, h] * kt[h, s] for s < L, 16 slots at a time, GN heads in registers.
template <int GN, typename T>
void ScoresBlock(const float* q, const T* kt, float* sc, int64_t H, int64_t S, int64_t L,
                 int64_t Lp) {
  for (int64_t s0 = 0; s0 < L; s0 += 16) {
    const int64_t n = std::min<int64_t>(16, S - s0);
    __m512 acc[GN];
    for (int g = 0; g < GN; ++g) acc[g] = _mm512_setzero_ps();
    for (int64_t h = 0; h < H; ++h) {
      const __m512 k = Load16(kt + h * S + s0, n);
      for (int g = 0; g < GN; ++g) acc[g] = _mm512_fmadd_ps(_mm512_set1_ps(q[g * H + h]), k, acc[g]);
    }
    for (int g = 0; g < GN; ++g) _mm512_storeu_ps(sc + g * Lp + s0, acc[g]);
  }
}

// acc[g, h] = sum_{s < L} p[g, s] * v[s, h], 16 columns at a time (H % 16 == 0).
template <int GN, typename T>
void ValuesBlock(const float* p, const T* v, float* acc, int64_t H, int64_t L, int64_t Lp) {
  for (int64_t h0 = 0; h0 < H; h0 += 16) {
    __m512 a[GN];
    for (int g = 0; g < GN; ++g) a[g] = _mm512_setzero_ps();
    for (int64_t s = 0; s < L; ++s) {
      const __m512 x = Load16(v + s * H + h0, 16);
      for (int g = 0; g < GN; ++g) a[g] = _mm512_fmadd_ps(_mm512_set1_ps(p[g * Lp + s]), x, a[g]);
    }
    for (int g = 0; g < GN; ++g) _mm512_storeu_ps(acc + g * H + h0, a[g]);
  }
}

#endif

// Scores for all G heads (scalar fallback when AVX-512 is not available).
template <typename T>
void Scores(const float* q, const T* kt, float* sc, int64_t G, int64_t H, int64_t S, int64_t L,
            int64_t Lp) {
#ifdef BA_AVX512
  int64_t g = 0;
  for (; g + 4 <= G; g += 4) ScoresBlock<4>(q + g * H, kt, sc + g * Lp, H, S, L, Lp);
  for (; g + 2 <= G; g += 2) ScoresBlock<2>(q + g * H, kt, sc + g * Lp, H, S, L, Lp);
  for (; g < G; ++g) ScoresBlock<1>(q + g * H, kt, sc + g * Lp, H, S, L, Lp);
#else
  for (int64_t g = 0; g < G; ++g)
    for (int64_t s = 0; s < L; ++s) {
      float dot = 0.0f;
      for (int64_t h = 0; h < H; ++h) dot += q[g * H + h] * Load(kt, h * S + s);
      sc[g * Lp + s] = dot;
    }
#endif
}

// acc[g, :] = sum_s p[g, s] * v[s, :] over s < L.
template <typename T>
void Values(const float* p, const T* v, float* acc, int64_t G, int64_t H, int64_t L,
            int64_t Lp) {
#ifdef BA_AVX512
  if (H % 16 == 0) {
    int64_t g = 0;
    for (; g + 4 <= G; g += 4) ValuesBlock<4>(p + g * Lp, v, acc + g * H, H, L, Lp);
    for (; g + 2 <= G; g += 2) ValuesBlock<2>(p + g * Lp, v, acc + g * H, H, L, Lp);
    for (; g < G; ++g) ValuesBlock<1>(p + g * Lp, v, acc + g * H, H, L, Lp);
    return;
  }
#endif
  std::fill(acc, acc + G * H, 0.0f);
  for (int64_t s = 0; s < L; ++s)
    for (int64_t g = 0; g < G; ++g)
      for (int64_t h = 0; h < H; ++h) acc[g * H + h] += p[g * Lp + s] * Load(v, s * H + h);
}

// p[s] = exp(p[s] - mx) for s < L -> their sum.
inline float ExpSub(float* p, int64_t L, float mx) {
  int64_t s = 0;
  float sum = 0.0f;
#ifdef BA_AVX512
  __m512 total = _mm512_setzero_ps();
  const __m512 m = _mm512_set1_ps(mx);
  for (; s + 16 <= L; s += 16) {
    const __m512 e = Exp16(_mm512_sub_ps(_mm512_loadu_ps(p + s), m));
    _mm512_storeu_ps(p + s, e);
    total = _mm512_add_ps(total, e);
  }
  if (s < L) {
    const __mmask16 k = static_cast<__mmask16>((1u << (L - s)) - 1);
    const __m512 e = _mm512_maskz_mov_ps(k, Exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, p + s), m)));
    _mm512_mask_storeu_ps(p + s, k, e);
    total = _mm512_add_ps(total, e);
    s = L;
  }
  sum = _mm512_reduce_add_ps(total);
#endif
  for (; s < L; ++s) {
    p[s] = std::exp(p[s] - mx);
    sum += p[s];
  }
  return sum;
}

// The prompt segment of BaDecodeAttentionShared (k == nullptr: none).
template <typename T>
struct PromptSegment {
  const T* k = nullptr;      // [P, K, H, Tp]
  const T* v = nullptr;      // [P, K, Tp, H]
  const int32_t* mask = nullptr;  // [P, Tp]
  int64_t P = 0, Tp = 0;
};

// Rows [b0, b1): write slot `index` (keys transposed: [H, S] per row and kv head), then attend
// over the prompt segment (if any) and slots 0..index.
template <typename T>
void AttendRows(const Dims& d, int64_t index, const T* q, const T* k_new, const T* v_new,
                T* k_cache, T* v_cache, const int32_t* mask, const PromptSegment<T>& pr,
                float* out, int64_t b0, int64_t b1, std::vector<float>& scratch) {
  const int64_t G = d.N / d.K, S = d.S, H = d.H;
  const int64_t Tp = pr.k ? pr.Tp : 0;
  const int64_t off = (Tp + 15) / 16 * 16;          // cache slots start at a whole chunk
  const int64_t L = std::min(index + 1, S);       // cache slots 0..index may be attended
  const int64_t Lp = off + (L + 15) / 16 * 16;    // [prompt | gap | cache], 16-slot chunks
  const int64_t rows_per_prompt = pr.k ? d.B / pr.P : 1;
  const float scale = 1.0f / std::sqrt(static_cast<float>(H));
  scratch.resize(G * H + G * Lp + 2 * G * H);
  float* qf = scratch.data();                      // [G, H] queries in f32
  float* sc = qf + G * H;                          // [G, Lp] scores, then probabilities
  float* acc = sc + G * Lp;                        // [G, H] outputs
  float* acc2 = acc + G * H;                       // [G, H] the cache segment's part
  for (int64_t b = b0; b < b1; ++b) {
    const int32_t* m = mask + b * S;
    const int64_t pb = b / rows_per_prompt;
    const int32_t* pm = pr.k ? pr.mask + pb * Tp : nullptr;
    bool any = false;
    for (int64_t s = 0; s < L; ++s) any |= m[s] != 0;
    for (int64_t s = 0; s < Tp; ++s) any |= pm[s] != 0;
    for (int64_t kh = 0; kh < d.K; ++kh) {
      T* kc = k_cache + (b * d.K + kh) * H * S;    // [H, S]
      T* vc = v_cache + (b * d.K + kh) * S * H;    // [S, H]
      const T* kp = pr.k ? pr.k + (pb * d.K + kh) * H * Tp : nullptr;  // [H, Tp]
      const T* vp = pr.k ? pr.v + (pb * d.K + kh) * Tp * H : nullptr;  // [Tp, H]
      const T* kn = k_new + (b * d.K + kh) * H;
      for (int64_t h = 0; h < H; ++h) kc[h * S + index] = kn[h];
      std::memcpy(vc + index * H, v_new + (b * d.K + kh) * H, H * sizeof(T));
      for (int64_t g = 0; g < G; ++g) {
        const T* qp = q + (b * d.N + kh * G + g) * H;
        for (int64_t h = 0; h < H; ++h) qf[g * H + h] = Load(qp, h);
      }
      if (Tp) Scores(qf, kp, sc, G, H, Tp, Tp, Lp);
      Scores(qf, kc, sc + off, G, H, S, L, Lp);
      for (int64_t g = 0; g < G; ++g) {
        float* p = sc + g * Lp;
        if (!any) {  // nothing to attend: uniform over all slots, as the XLA path does
          continue;
        }
        float mx = -INFINITY;
        for (int64_t s = 0; s < off; ++s) {
          p[s] = s < Tp && pm[s] ? p[s] * scale : -INFINITY;
          mx = std::max(mx, p[s]);
        }
        for (int64_t s = 0; s < L; ++s) {
          p[off + s] = m[s] ? p[off + s] * scale : -INFINITY;
          mx = std::max(mx, p[off + s]);
        }
        const int64_t n = off + L;
        float sum = ExpSub(p, n, mx);
        const float inv = 1.0f / sum;
        for (int64_t s = 0; s < n; ++s) {
          float v = p[s] * inv;
          p[s] = sizeof(T) == 2 ? RoundToBf16(v) : v;
        }
      }
      if (any) {
        Values(sc + off, vc, acc, G, H, L, Lp);
        if (Tp) {
          Values(sc, vp, acc2, G, H, Tp, Lp);
          for (int64_t i = 0; i < G * H; ++i) acc[i] += acc2[i];
        }
      } else {
        std::fill(acc, acc + G * H, 0.0f);
        const float u = sizeof(T) == 2 ? RoundToBf16(1.0f / (S + Tp)) : 1.0f / (S + Tp);
        for (int64_t s = 0; s < S; ++s)
          for (int64_t g = 0; g < G; ++g)
            for (int64_t h = 0; h < H; ++h) acc[g * H + h] += u * Load(vc + s * H, h);
        for (int64_t s = 0; s < Tp; ++s)
          for (int64_t g = 0; g < G; ++g)
            for (int64_t h = 0; h < H; ++h) acc[g * H + h] += u * Load(vp + s * H, h);
      }
      for (int64_t g = 0; g < G; ++g) {
        std::memcpy(out + (b * d.N + kh * G + g) * H, acc + g * H, H * sizeof(float));
      }
    }
  }
}

// Rows are handed out in blocks of 4 over the calling thread and the pool.
template <typename T>
ffi::Error Run(ffi::ThreadPool pool, const Dims& d, int64_t index, const T* q,
               const T* k_new, const T* v_new, T* k_cache, T* v_cache, const int32_t* mask,
               const PromptSegment<T>& pr, float* out) {
  const int64_t block = 4;
  ba_native::ParallelFor(pool, (d.B + block - 1) / block, [=](int64_t i) {
    thread_local std::vector<float> scratch;
    AttendRows(d, index, q, k_new, v_new, k_cache, v_cache, mask, pr, out, i * block,
               std::min(d.B, (i + 1) * block), scratch);
  });
  return ffi::Error::Success();
}

// Shared by both handlers; prompt_k == nullptr: no prompt segment.
ffi::Error Dispatch(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k_new,
                    ffi::AnyBuffer v_new, ffi::AnyBuffer k_cache, ffi::AnyBuffer v_cache,
                    ffi::Buffer<ffi::S32> mask, ffi::Buffer<ffi::S32> index,
                    ffi::Result<ffi::Buffer<ffi::F32>> out, ffi::Result<ffi::AnyBuffer> k_out,
                    ffi::Result<ffi::AnyBuffer> v_out, const ffi::AnyBuffer* prompt_k,
                    const ffi::AnyBuffer* prompt_v, const ffi::Buffer<ffi::S32>* prompt_mask) {
  auto qd = q.dimensions(), kd = k_cache.dimensions(), vd = v_cache.dimensions();
  if (qd.size() != 3 || kd.size() != 4 || vd.size() != 4) {
    return ffi::Error::InvalidArgument(
        "decode_attention: q must be [B,N,H], k_cache [B,K,H,S], v_cache [B,K,S,H]");
  }
  const Dims d{qd[0], qd[1], vd[1], vd[2], qd[2]};
  if (kd[0] != d.B || vd[0] != d.B || kd[1] != d.K || kd[2] != d.H || kd[3] != d.S ||
      vd[3] != d.H || d.N % d.K != 0 || q.element_type() != k_cache.element_type()) {
    return ffi::Error::InvalidArgument("decode_attention: inconsistent shapes or dtypes");
  }
  int64_t P = 0, Tp = 0;
  if (prompt_k) {
    auto pk = prompt_k->dimensions(), pv = prompt_v->dimensions(),
         pm = prompt_mask->dimensions();
    if (pk.size() != 4 || pv.size() != 4 || pm.size() != 2) {
      return ffi::Error::InvalidArgument(
          "decode_attention: k_prompt must be [P,K,H,Tp], v_prompt [P,K,Tp,H], mask [P,Tp]");
    }
    P = pk[0];
    Tp = pk[3];
    if (P <= 0 || d.B % P != 0 || pk[1] != d.K || pk[2] != d.H || pv[0] != P ||
        pv[1] != d.K || pv[2] != Tp || pv[3] != d.H || pm[0] != P || pm[1] != Tp ||
        prompt_k->element_type() != q.element_type() ||
        prompt_v->element_type() != q.element_type()) {
      return ffi::Error::InvalidArgument(
          "decode_attention: prompt segment shapes or dtypes do not match the rows");
    }
  }
  const int64_t idx = index.typed_data()[0];
  if (idx < 0 || idx >= d.S) {
    return ffi::Error::InvalidArgument("decode_attention: cache index out of range");
  }
  const size_t cache_bytes = k_cache.size_bytes();
  // The cache is aliased to the result; if XLA gave a separate buffer, start from a copy.
  if (k_out->untyped_data() != k_cache.untyped_data()) {
    std::memcpy(k_out->untyped_data(), k_cache.untyped_data(), cache_bytes);
  }
  if (v_out->untyped_data() != v_cache.untyped_data()) {
    std::memcpy(v_out->untyped_data(), v_cache.untyped_data(), cache_bytes);
  }
  switch (q.element_type()) {
    case ffi::F32: {
      PromptSegment<float> pr;
      if (prompt_k) {
        pr = {reinterpret_cast<const float*>(prompt_k->untyped_data()),
              reinterpret_cast<const float*>(prompt_v->untyped_data()),
              prompt_mask->typed_data(), P, Tp};
      }
      return Run<float>(pool, d, idx, q.typed_data<float>(), k_new.typed_data<float>(),
                        v_new.typed_data<float>(), k_out->typed_data<float>(),
                        v_out->typed_data<float>(), mask.typed_data(), pr, out->typed_data());
    }
    case ffi::BF16: {
      PromptSegment<uint16_t> pr;
      if (prompt_k) {
        pr = {reinterpret_cast<const uint16_t*>(prompt_k->untyped_data()),
              reinterpret_cast<const uint16_t*>(prompt_v->untyped_data()),
              prompt_mask->typed_data(), P, Tp};
      }
      return Run<uint16_t>(
          pool, d, idx, reinterpret_cast<const uint16_t*>(q.untyped_data()),
          reinterpret_cast<const uint16_t*>(k_new.untyped_data()),
          reinterpret_cast<const uint16_t*>(v_new.untyped_data()),
          reinterpret_cast<uint16_t*>(k_out->untyped_data()),
          reinterpret_cast<uint16_t*>(v_out->untyped_data()), mask.typed_data(), pr,
          out->typed_data());
    }
    default:
      return ffi::Error::InvalidArgument("decode_attention: dtype must be f32 or bf16");
  }
}

ffi::Error DecodeAttention(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k_new,
                           ffi::AnyBuffer v_new, ffi::AnyBuffer k_cache, ffi::AnyBuffer v_cache,
                           ffi::Buffer<ffi::S32> mask, ffi::Buffer<ffi::S32> index,
                           ffi::Result<ffi::Buffer<ffi::F32>> out,
                           ffi::Result<ffi::AnyBuffer> k_out, ffi::Result<ffi::AnyBuffer> v_out) {
  return Dispatch(pool, q, k_new, v_new, k_cache, v_cache, mask, index, out, k_out, v_out,
                  nullptr, nullptr, nullptr);
}

ffi::Error DecodeAttentionShared(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k_new,
                                 ffi::AnyBuffer v_new, ffi::AnyBuffer k_cache,
                                 ffi::AnyBuffer v_cache, ffi::Buffer<ffi::S32> mask,
                                 ffi::Buffer<ffi::S32> index, ffi::AnyBuffer k_prompt,
                                 ffi::AnyBuffer v_prompt, ffi::Buffer<ffi::S32> prompt_mask,
                                 ffi::Result<ffi::Buffer<ffi::F32>> out,
                                 ffi::Result<ffi::AnyBuffer> k_out,
                                 ffi::Result<ffi::AnyBuffer> v_out) {
  return Dispatch(pool, q, k_new, v_new, k_cache, v_cache, mask, index, out, k_out, v_out,
                  &k_prompt, &v_prompt, &prompt_mask);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(BaDecodeAttention, DecodeAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(BaDecodeAttentionShared, DecodeAttentionShared,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());
