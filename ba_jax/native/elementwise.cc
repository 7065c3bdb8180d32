// Fused elementwise kernels of the model's training forward and backward, as XLA FFI calls:
// the MLP's SwiGLU activation and RMSNorm.
//
// Why they exist: XLA:CPU evaluates these op by op on bfloat16 operands with a rounding
// after each, keeps float32 intermediates as autodiff residuals, and spends several passes
// over memory per norm or activation on each side (together about a fifth of the bf16 train
// step of the benchmark model). Here each side is one pass over its operands.
//
// SwiGLU, h = silu(g) * u, with g and u the two halves of the last axis of gu [..., 2F] (the
// output of one product by the concatenated gate and up weights). Numerics (D = float32 or
// bfloat16; round = to D, to nearest even, identity for float32), as PyTorch's bf16 ops and
// `fused.swiglu`: all in float32,
//   sig = 1 / (1 + exp(-g)),  s = round(g sig),  h = round(s u)
//   du = round(dh s),  ds = round(dh u),  dg = round(ds sig (1 + g (1 - sig)))
// h, dh [..., F]; the gradient dgu [..., 2F] = (dg, du); all of dtype D; sigmoid(g) is
// recomputed backward.
//
// RMSNorm over the last axis (H) of x [..., H] D with a float32 scale [H], as `qwen.RMSNorm`:
//   r = 1 / sqrt(mean(x^2) + eps),  y = round((x r) scale)
//   backward, for dy D:  n = x r,  e = dy scale,  dx = round(r (e - n mean(e n))),
//   dscale = sum over rows of dy n (float32; per-unit partial sums added at the end)
// Work is split into runs of whole rows (about kRun elements each) over the calling thread and
// XLA's intra-op pool.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "buffers.h"
#include "parallel.h"
#include "simd.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kRun = 16384;  // elements per work unit

#ifdef BA_AVX512

using ba_native::In;
using ba_native::Out;

inline __m512 Sigmoid16(__m512 g) {
  const __m512 one = _mm512_set1_ps(1.0f);
  return _mm512_div_ps(one, _mm512_add_ps(one, Exp16(_mm512_sub_ps(_mm512_setzero_ps(), g))));
}

// Rows [r0, r1) of gu [rows, 2F] (gate then up) -> h [rows, F].
template <typename T>
void ForwardRows(const T* gu, T* h, int64_t f, int64_t r0, int64_t r1) {
  for (int64_t r = r0; r < r1; ++r) {
    const T *g = gu + r * 2 * f, *u = g + f;
    for (int64_t i = 0; i < f; i += 16) {
      const int64_t n = std::min<int64_t>(16, f - i);
      const __m512 gv = Load16(g + i, n);
      const __m512 s = Round(_mm512_mul_ps(gv, Sigmoid16(gv)), T{});
      Store16(h + r * f + i, _mm512_mul_ps(s, Load16(u + i, n)), n);
    }
  }
}

// Rows [r0, r1): gu [rows, 2F], dh [rows, F] -> dgu [rows, 2F] (dg then du).
template <typename T>
void BackwardRows(const T* gu, const T* dh, T* dgu, int64_t f, int64_t r0, int64_t r1) {
  const __m512 one = _mm512_set1_ps(1.0f);
  for (int64_t r = r0; r < r1; ++r) {
    const T *g = gu + r * 2 * f, *u = g + f, *dhr = dh + r * f;
    T *dg = dgu + r * 2 * f, *du = dg + f;
    for (int64_t i = 0; i < f; i += 16) {
      const int64_t n = std::min<int64_t>(16, f - i);
      const __m512 gv = Load16(g + i, n), dhv = Load16(dhr + i, n);
      const __m512 sig = Sigmoid16(gv);
      const __m512 s = Round(_mm512_mul_ps(gv, sig), T{});
      Store16(du + i, _mm512_mul_ps(dhv, s), n);
      const __m512 ds = Round(_mm512_mul_ps(dhv, Load16(u + i, n)), T{});
      // sig (1 + g (1 - sig)): the derivative of g sig
      const __m512 dsilu = _mm512_mul_ps(sig, _mm512_fmadd_ps(gv, _mm512_sub_ps(one, sig), one));
      Store16(dg + i, _mm512_mul_ps(ds, dsilu), n);
    }
  }
}

// Rows per work unit for rows of f elements: about kRun elements.
int64_t UnitRows(int64_t f) { return std::max<int64_t>(1, kRun / std::max<int64_t>(f, 1)); }

// gu [..., 2F] and h (or dh) [..., F] of one dtype, f32 or bf16 -> rows and F.
ffi::Error CheckSwiglu(const char* name, const ffi::AnyBuffer& gu, const ffi::AnyBuffer& h,
                       int64_t& rows, int64_t& f) {
  const auto gd = gu.dimensions(), hd = h.dimensions();
  bool ok = (gu.element_type() == ffi::F32 || gu.element_type() == ffi::BF16) &&
            h.element_type() == gu.element_type() && gd.size() >= 1 &&
            gd.size() == hd.size() && hd.back() * 2 == gd.back();
  for (size_t i = 0; ok && i + 1 < gd.size(); ++i) ok = gd[i] == hd[i];
  if (!ok) {
    return ffi::Error::InvalidArgument(std::string(name) +
                                       ": gu must be [..., 2F] and h [..., F], one dtype, "
                                       "f32 or bf16");
  }
  f = hd.back();
  rows = f == 0 ? 0 : h.element_count() / f;
  return ffi::Error::Success();
}

ffi::Error Forward(ffi::ThreadPool pool, ffi::AnyBuffer gu, ffi::Result<ffi::AnyBuffer> h) {
  int64_t rows, f;
  if (auto err = CheckSwiglu("swiglu", gu, *h, rows, f); err.failure()) return err;
  const int64_t per = UnitRows(f);
  auto run = [&](auto tag) {
    using T = decltype(tag);
    const T* gp = In<T>(gu);
    T* hp = Out<T>(h);
    ba_native::ParallelFor(pool, (rows + per - 1) / per, [=](int64_t j) {
      ForwardRows(gp, hp, f, j * per, std::min(rows, (j + 1) * per));
    });
  };
  if (gu.element_type() == ffi::F32) run(float{}); else run(uint16_t{});
  return ffi::Error::Success();
}

ffi::Error Backward(ffi::ThreadPool pool, ffi::AnyBuffer gu, ffi::AnyBuffer dh,
                    ffi::Result<ffi::AnyBuffer> dgu) {
  int64_t rows, f;
  if (auto err = CheckSwiglu("swiglu backward", gu, dh, rows, f); err.failure()) return err;
  if (dgu->element_count() != gu.element_count()) {
    return ffi::Error::InvalidArgument("swiglu backward: dgu must match gu");
  }
  const int64_t per = UnitRows(f);
  auto run = [&](auto tag) {
    using T = decltype(tag);
    const T *gp = In<T>(gu), *dhp = In<T>(dh);
    T* dp = Out<T>(dgu);
    ba_native::ParallelFor(pool, (rows + per - 1) / per, [=](int64_t j) {
      BackwardRows(gp, dhp, dp, f, j * per, std::min(rows, (j + 1) * per));
    });
  };
  if (gu.element_type() == ffi::F32) run(float{}); else run(uint16_t{});
  return ffi::Error::Success();
}

inline float Sum16(__m512 x) { return _mm512_reduce_add_ps(x); }

template <typename T>
float RowRsqrt(const T* x, int64_t h, float eps) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t j = 0; j < h; j += 16) {
    const __m512 v = Load16(x + j, h - j);
    acc = _mm512_fmadd_ps(v, v, acc);
  }
  return 1.0f / std::sqrt(Sum16(acc) / static_cast<float>(h) + eps);
}

template <typename T>
void NormForwardRows(const T* x, const float* scale, T* y, int64_t h, float eps, int64_t r0,
                     int64_t r1) {
  for (int64_t r = r0; r < r1; ++r) {
    const T* xr = x + r * h;
    const __m512 rs = _mm512_set1_ps(RowRsqrt(xr, h, eps));
    for (int64_t j = 0; j < h; j += 16) {
      const int64_t n = std::min<int64_t>(16, h - j);
      const __m512 v = _mm512_mul_ps(Load16(xr + j, n), rs);
      Store16(y + r * h + j, _mm512_mul_ps(v, Load16(scale + j, n)), n);
    }
  }
}

template <typename T>
void NormBackwardRows(const T* x, const float* scale, const T* dy, T* dx, float* dscale,
                      int64_t h, float eps, int64_t r0, int64_t r1) {
  for (int64_t r = r0; r < r1; ++r) {
    const T *xr = x + r * h, *dyr = dy + r * h;
    __m512 sq = _mm512_setzero_ps(), dot = _mm512_setzero_ps();
    for (int64_t j = 0; j < h; j += 16) {
      const int64_t n = std::min<int64_t>(16, h - j);
      const __m512 v = Load16(xr + j, n);
      sq = _mm512_fmadd_ps(v, v, sq);
      dot = _mm512_fmadd_ps(_mm512_mul_ps(Load16(dyr + j, n), Load16(scale + j, n)), v, dot);
    }
    const float rs = 1.0f / std::sqrt(Sum16(sq) / static_cast<float>(h) + eps);
    // mean(e n) = r dot / h; dx = r e - x r^2 mean(e n)
    const __m512 rv = _mm512_set1_ps(rs);
    const __m512 c = _mm512_set1_ps(rs * rs * (rs * Sum16(dot) / static_cast<float>(h)));
    for (int64_t j = 0; j < h; j += 16) {
      const int64_t n = std::min<int64_t>(16, h - j);
      const __m512 v = Load16(xr + j, n), d = Load16(dyr + j, n);
      const __m512 e = _mm512_mul_ps(d, Load16(scale + j, n));
      Store16(dx + r * h + j, _mm512_fnmadd_ps(v, c, _mm512_mul_ps(e, rv)), n);
      Store16(dscale + j, _mm512_fmadd_ps(d, _mm512_mul_ps(v, rv), Load16(dscale + j, n)), n);
    }
  }
}

ffi::Error CheckNorm(const char* name, ffi::AnyBuffer x, ffi::Buffer<ffi::F32> scale,
                     int64_t& rows, int64_t& h) {
  const auto xd = x.dimensions();
  if ((x.element_type() != ffi::F32 && x.element_type() != ffi::BF16) || xd.size() < 1 ||
      scale.dimensions().size() != 1 || scale.dimensions()[0] != xd.back()) {
    return ffi::Error::InvalidArgument(std::string(name) +
                                       ": x must be f32 or bf16 [..., H], scale f32 [H]");
  }
  h = xd.back();
  rows = h == 0 ? 0 : x.element_count() / h;
  return ffi::Error::Success();
}

ffi::Error NormForward(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Buffer<ffi::F32> scale,
                       ffi::Result<ffi::AnyBuffer> y, float eps) {
  int64_t rows, h;
  if (auto err = CheckNorm("rms_norm", x, scale, rows, h); err.failure()) return err;
  const float* sp = scale.typed_data();
  const int64_t per = UnitRows(h);
  auto run = [&](auto tag) {
    using T = decltype(tag);
    const T* xp = In<T>(x);
    T* yp = Out<T>(y);
    ba_native::ParallelFor(pool, (rows + per - 1) / per, [=](int64_t j) {
      NormForwardRows(xp, sp, yp, h, eps, j * per, std::min(rows, (j + 1) * per));
    });
  };
  if (x.element_type() == ffi::F32) run(float{}); else run(uint16_t{});
  return ffi::Error::Success();
}

ffi::Error NormBackward(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Buffer<ffi::F32> scale,
                        ffi::AnyBuffer dy, ffi::Result<ffi::AnyBuffer> dx,
                        ffi::Result<ffi::Buffer<ffi::F32>> dscale, float eps) {
  int64_t rows, h;
  if (auto err = CheckNorm("rms_norm backward", x, scale, rows, h); err.failure()) return err;
  if (dy.element_type() != x.element_type() || dy.element_count() != x.element_count()) {
    return ffi::Error::InvalidArgument("rms_norm backward: dy must match x");
  }
  const float* sp = scale.typed_data();
  const int64_t per = UnitRows(h), units = (rows + per - 1) / per;
  // one partial scale gradient per unit, summed in unit order (deterministic)
  auto partial = std::make_shared<std::vector<float>>(units * h, 0.0f);
  float* pp = partial->data();
  auto run = [&](auto tag) {
    using T = decltype(tag);
    const T *xp = In<T>(x), *dyp = In<T>(dy);
    T* dxp = Out<T>(dx);
    ba_native::ParallelFor(pool, units, [=](int64_t j) {
      (void)partial;
      NormBackwardRows(xp, sp, dyp, dxp, pp + j * h, h, eps, j * per,
                       std::min(rows, (j + 1) * per));
    });
  };
  if (x.element_type() == ffi::F32) run(float{}); else run(uint16_t{});
  float* ds = dscale->typed_data();
  std::fill(ds, ds + h, 0.0f);
  for (int64_t j = 0; j < units; ++j) {
    for (int64_t i = 0; i < h; ++i) ds[i] += pp[j * h + i];
  }
  return ffi::Error::Success();
}

#else  // no AVX-512: Python keeps XLA's ops (BaAttentionAvailable() == 0)

ffi::Error Forward(ffi::ThreadPool, ffi::AnyBuffer, ffi::Result<ffi::AnyBuffer>) {
  return ffi::Error::InvalidArgument("swiglu kernel built without AVX-512");
}

ffi::Error Backward(ffi::ThreadPool, ffi::AnyBuffer, ffi::AnyBuffer,
                    ffi::Result<ffi::AnyBuffer>) {
  return ffi::Error::InvalidArgument("swiglu kernel built without AVX-512");
}

ffi::Error NormForward(ffi::ThreadPool, ffi::AnyBuffer, ffi::Buffer<ffi::F32>,
                       ffi::Result<ffi::AnyBuffer>, float) {
  return ffi::Error::InvalidArgument("rms_norm kernel built without AVX-512");
}

ffi::Error NormBackward(ffi::ThreadPool, ffi::AnyBuffer, ffi::Buffer<ffi::F32>, ffi::AnyBuffer,
                        ffi::Result<ffi::AnyBuffer>, ffi::Result<ffi::Buffer<ffi::F32>>, float) {
  return ffi::Error::InvalidArgument("rms_norm kernel built without AVX-512");
}

#endif

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(BaSwigluForward, Forward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(BaSwigluBackward, Backward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(BaRmsNormForward, NormForward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<float>("eps"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(BaRmsNormBackward, NormBackward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("eps"));
