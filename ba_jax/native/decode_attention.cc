// One-token cached attention for CPU decoding, as an XLA FFI custom call.
//
// Why it exists: on XLA:CPU the decode step's attention is a batched matrix-vector product
// per (row, kv head) that the generic dot kernels run at a few GFLOP/s, and a bfloat16
// dynamic_update_slice of the cache is rewritten through float32 (the whole cache, every
// step). This kernel writes the new key/value into the cache in place (the cache buffers
// are aliased input -> output) and attends over the *valid* slots only, reading each slot
// once for all query heads of its kv group. Numerics follow `qwen.Attention`: products
// and sums in float32, softmax in float32, probabilities rounded to the cache dtype before
// the value sum when that dtype is bfloat16.
//
// Operands (B rows, N query heads, K kv heads, S slots, H head dim; D = f32 or bf16):
//   q [B, N, H] D (after RoPE), k_new [B, K, H] D (after RoPE), v_new [B, K, H] D,
//   k_cache [B, K, S, H] D, v_cache [B, K, S, H] D, mask [B, S] s32, index [] s32
// Results: out [B, N, H] f32, k_cache, v_cache (aliased to the operands).
// Slot s of row b is attended iff mask[b, s] != 0 and s <= index; the new key/value are
// written to slot `index` first. A row with no attended slot averages all S slots
// uniformly (the -1e30 masking of the XLA path gives the same).

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <vector>

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

#if defined(__AVX512F__)
#include <immintrin.h>

inline __m512 Load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 Load16(const uint16_t* p) {  // 16 bf16 -> f32: the bits shifted into the high half
  __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
#endif

// sum_h a[h] * b[h] with float32 products and sums (a already float32).
template <typename T>
inline float Dot(const float* a, const T* b, int64_t n) {
  int64_t h = 0;
  float s = 0.0f;
#if defined(__AVX512F__)
  if (n >= 16) {
    __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(a), Load16(b));
    for (h = 16; h + 16 <= n; h += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + h), Load16(b + h), acc);
    s = _mm512_reduce_add_ps(acc);
  }
#endif
  for (; h < n; ++h) s += a[h] * Load(b, h);
  return s;
}

// acc[h] += p * b[h]
template <typename T>
inline void Axpy(float p, const T* b, float* acc, int64_t n) {
  int64_t h = 0;
#if defined(__AVX512F__)
  const __m512 pv = _mm512_set1_ps(p);
  for (; h + 16 <= n; h += 16) {
    _mm512_storeu_ps(acc + h, _mm512_fmadd_ps(pv, Load16(b + h), _mm512_loadu_ps(acc + h)));
  }
#endif
  for (; h < n; ++h) acc[h] += p * Load(b, h);
}

struct Dims {
  int64_t B, N, K, S, H;
};

// Rows [b0, b1): write slot `index`, then attend. `scratch` holds G*S scores + H floats.
template <typename T>
void AttendRows(const Dims& d, int64_t index, const T* q, const T* k_new, const T* v_new,
                T* k_cache, T* v_cache, const int32_t* mask, float* out, int64_t b0,
                int64_t b1, std::vector<float>& scratch) {
  const int64_t G = d.N / d.K, S = d.S, H = d.H;
  const float scale = 1.0f / std::sqrt(static_cast<float>(H));
  scratch.resize(G * S + G * H + H);
  float* scores = scratch.data();
  float* acc = scores + G * S;
  float* qf = acc + G * H;  // reused per query head below
  std::vector<int32_t> slots;
  slots.reserve(S);
  for (int64_t b = b0; b < b1; ++b) {
    slots.clear();
    for (int64_t s = 0; s <= index && s < S; ++s) {
      if (mask[b * S + s]) slots.push_back(static_cast<int32_t>(s));
    }
    const bool uniform = slots.empty();
    if (uniform) {
      for (int64_t s = 0; s < S; ++s) slots.push_back(static_cast<int32_t>(s));
    }
    const int64_t L = static_cast<int64_t>(slots.size());
    for (int64_t kh = 0; kh < d.K; ++kh) {
      T* kc = k_cache + (b * d.K + kh) * S * H;
      T* vc = v_cache + (b * d.K + kh) * S * H;
      std::memcpy(kc + index * H, k_new + (b * d.K + kh) * H, H * sizeof(T));
      std::memcpy(vc + index * H, v_new + (b * d.K + kh) * H, H * sizeof(T));
      // Scores: one pass over the attended keys for all G query heads of this kv head.
      for (int64_t g = 0; g < G; ++g) {
        const T* qp = q + (b * d.N + kh * G + g) * H;
        for (int64_t h = 0; h < H; ++h) qf[h] = Load(qp, h);
        float* sc = scores + g * S;
        for (int64_t j = 0; j < L; ++j) {
          const T* kp = kc + static_cast<int64_t>(slots[j]) * H;
          sc[j] = uniform ? 0.0f : Dot(qf, kp, H) * scale;
        }
        float mx = -INFINITY;
        for (int64_t j = 0; j < L; ++j) mx = std::max(mx, sc[j]);
        float sum = 0.0f;
        for (int64_t j = 0; j < L; ++j) {
          sc[j] = std::exp(sc[j] - mx);
          sum += sc[j];
        }
        const float inv = 1.0f / sum;
        for (int64_t j = 0; j < L; ++j) {
          float p = sc[j] * inv;
          sc[j] = sizeof(T) == 2 ? RoundToBf16(p) : p;
        }
      }
      // Values: one pass over the attended values for all G query heads.
      std::fill(acc, acc + G * H, 0.0f);
      for (int64_t j = 0; j < L; ++j) {
        const T* vp = vc + static_cast<int64_t>(slots[j]) * H;
        for (int64_t g = 0; g < G; ++g) Axpy(scores[g * S + j], vp, acc + g * H, H);
      }
      for (int64_t g = 0; g < G; ++g) {
        std::memcpy(out + (b * d.N + kh * G + g) * H, acc + g * H, H * sizeof(float));
      }
    }
  }
}

// Rows are handed out in blocks from an atomic counter, to the calling thread and to up to
// (pool threads) helpers. The caller never waits for a helper that has not started: it
// only waits for blocks already claimed, so a busy pool cannot deadlock the call.
struct Shared {
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  std::mutex mu;
  std::condition_variable cv;
};

template <typename T>
ffi::Error Run(ffi::ThreadPool pool, const Dims& d, int64_t index, const T* q,
               const T* k_new, const T* v_new, T* k_cache, T* v_cache, const int32_t* mask,
               float* out) {
  const int64_t block = 4;
  const int64_t nblocks = (d.B + block - 1) / block;
  auto shared = std::make_shared<Shared>();
  auto work = [=](std::vector<float>& scratch) {
    for (;;) {
      const int64_t i = shared->next.fetch_add(1);
      if (i >= nblocks) return;
      AttendRows(d, index, q, k_new, v_new, k_cache, v_cache, mask, out, i * block,
                 std::min(d.B, (i + 1) * block), scratch);
      if (shared->done.fetch_add(1) + 1 == nblocks) {
        std::lock_guard<std::mutex> lock(shared->mu);
        shared->cv.notify_all();
      }
    }
  };
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), nblocks - 1);
  for (int64_t t = 0; t < helpers; ++t) {
    pool.Schedule([work]() {
      std::vector<float> scratch;
      work(scratch);
    });
  }
  std::vector<float> scratch;
  work(scratch);
  std::unique_lock<std::mutex> lock(shared->mu);
  shared->cv.wait(lock, [&] { return shared->done.load() == nblocks; });
  return ffi::Error::Success();
}

ffi::Error DecodeAttention(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k_new,
                           ffi::AnyBuffer v_new, ffi::AnyBuffer k_cache, ffi::AnyBuffer v_cache,
                           ffi::Buffer<ffi::S32> mask, ffi::Buffer<ffi::S32> index,
                           ffi::Result<ffi::Buffer<ffi::F32>> out,
                           ffi::Result<ffi::AnyBuffer> k_out, ffi::Result<ffi::AnyBuffer> v_out) {
  auto qd = q.dimensions(), cd = k_cache.dimensions();
  if (qd.size() != 3 || cd.size() != 4) {
    return ffi::Error::InvalidArgument("decode_attention: q must be [B,N,H], cache [B,K,S,H]");
  }
  const Dims d{qd[0], qd[1], cd[1], cd[2], qd[2]};
  if (cd[0] != d.B || cd[3] != d.H || d.N % d.K != 0 || q.element_type() != k_cache.element_type()) {
    return ffi::Error::InvalidArgument("decode_attention: inconsistent shapes or dtypes");
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
    case ffi::F32:
      return Run<float>(pool, d, idx, q.typed_data<float>(), k_new.typed_data<float>(),
                        v_new.typed_data<float>(), k_out->typed_data<float>(),
                        v_out->typed_data<float>(), mask.typed_data(), out->typed_data());
    case ffi::BF16:
      return Run<uint16_t>(
          pool, d, idx, reinterpret_cast<const uint16_t*>(q.untyped_data()),
          reinterpret_cast<const uint16_t*>(k_new.untyped_data()),
          reinterpret_cast<const uint16_t*>(v_new.untyped_data()),
          reinterpret_cast<uint16_t*>(k_out->untyped_data()),
          reinterpret_cast<uint16_t*>(v_out->untyped_data()), mask.typed_data(),
          out->typed_data());
    default:
      return ffi::Error::InvalidArgument("decode_attention: dtype must be f32 or bf16");
  }
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
