// bfloat16 matrix product on Intel AMX tiles, float32 result, as an XLA FFI custom call.
//
// Why it exists: XLA:CPU runs a bf16 x bf16 -> f32 dot through YNNPACK at 100-140 GFLOP/s
// per core on this model's shapes, while the processor's AMX tile unit (TMUL) multiplies
// 16x32 by 32x16 bfloat16 tiles into float32 in one instruction. The training step and
// the decode step are dominated by such products.
//
// C[M, N] = op(A) @ op(B), accumulated in float32 and returned in float32 or bfloat16
// (rounded once, to nearest even: what XLA's dot to float32 then convert gives):
//   a: [M, K] bf16, or [K, M] when transpose_a (then op(A) = a^T)
//   b: [K, N] bf16, or [N, K] when transpose_b (then op(B) = b^T)
// Each call packs op(B) into the tile unit's pair-interleaved layout (zero-padded to
// multiples of 32) and, when op(A) is not already row-major with padded sizes, op(A)
// into a padded row-major copy; then 32x32 blocks of C are computed by 2x2 tiles over K.
// Work is split over the calling thread and XLA's intra-op pool (parallel.h): first the
// packing units, then the compute units (a compute unit waits for the packing, which is all
// claimed by then, so a busy pool cannot deadlock the call). Products of bf16 values are
// exact in float32; only the summation order differs from XLA's dot.
//
// BaAmxAvailable() tells Python whether the processor has AMX-BF16 and the kernel granted
// the process the tile data state (Linux arch_prctl); without it callers use XLA's dot.

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <utility>
#include <thread>
#include <vector>

#include "amx.h"
#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kTile = 16;      // rows of a tile (and columns of a C/B tile)
constexpr int64_t kTileK = 32;     // bf16 elements along K in one A tile row
constexpr int64_t kBlock = 32;     // C block: 2 x 2 tiles
constexpr int64_t kPanelN = 256;   // columns of one compute unit (B panel stays in L2)
constexpr int64_t kPanelM = 128;   // rows of one compute unit

using ba_amx::AmxReady;
using ba_amx::ConfigureTiles;

struct Plan {
  int64_t M, K, N;     // logical sizes of C = op(A) @ op(B)
  int64_t Mp, Kp, Np;  // padded to multiples of kBlock
  bool ta, tb;
  const uint16_t* a;
  const uint16_t* b;
  float* c;           // float32 result, or
  uint16_t* c_bf16;   // bfloat16 result (rounded to nearest even, as XLA's convert)
  const uint16_t* a_rows;  // op(A) as row-major [Mp, Kp] (a itself or a_pad)
  uint16_t* a_pad;         // nullptr when a is used in place
  uint16_t* b_pack;        // [Np / 16][Kp / 32][16][32]: row r of a tile holds the pairs
                           // (B[2r, n], B[2r + 1, n]) for its 16 columns n
};

inline uint16_t OpA(const Plan& p, int64_t m, int64_t k) {
  return p.ta ? p.a[k * p.M + m] : p.a[m * p.K + k];
}

inline uint16_t OpB(const Plan& p, int64_t k, int64_t n) {
  return p.tb ? p.b[n * p.K + k] : p.b[k * p.N + n];
}

// Rows [m0, m1) of the padded row-major copy of op(A).
BA_AMX void PadA(const Plan& p, int64_t m0, int64_t m1) {
  const int64_t mv = std::min(m1, p.M);  // rows past M are zero padding
  for (int64_t m = std::max(m0, mv); m < m1; ++m) {
    std::memset(p.a_pad + m * p.Kp, 0, p.Kp * sizeof(uint16_t));
  }
  for (int64_t m = m0; m < mv; ++m) {
    uint16_t* row = p.a_pad + m * p.Kp;
    if (!p.ta) std::memcpy(row, p.a + m * p.K, p.K * sizeof(uint16_t));
    std::memset(row + p.K, 0, (p.Kp - p.K) * sizeof(uint16_t));
  }
  if (!p.ta) return;
  // Transposed a ([K, M]). k runs outside the rows so that a pass reads a few neighbouring
  // lines of a (rows m-major inside would walk all K rows of a, one page each, per row).
  int64_t paired = m0;  // rows [m0, paired) are written in pairs by gathers
  if (p.M % 2 == 0 && p.M * 2 * 32 < (int64_t{1} << 31)) {
    // Rows m and m + 1 of op(A) come from one gather of the 32-bit pairs
    // (a[k, m], a[k, m + 1]) over 16 k, then a split into even and odd halves.
    const __m512i even = _mm512_set_epi16(62, 60, 58, 56, 54, 52, 50, 48, 46, 44, 42, 40,
                                          38, 36, 34, 32, 30, 28, 26, 24, 22, 20, 18, 16, 14,
                                          12, 10, 8, 6, 4, 2, 0);
    const __m512i odd = _mm512_add_epi16(even, _mm512_set1_epi16(1));
    const __m512i rows16 = _mm512_mullo_epi32(
        _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
        _mm512_set1_epi32(static_cast<int>(p.M * 2)));
    paired = m0 + (mv - m0) / 2 * 2;  // m0 is even (a multiple of 64)
    int64_t k = 0;
    for (; k + 32 <= p.K; k += 32) {
      for (int64_t m = m0; m < paired; m += 2) {
        const void* base = p.a + k * p.M + m;
        const __m512i lo = _mm512_i32gather_epi32(rows16, base, 1);
        const __m512i hi = _mm512_i32gather_epi32(rows16, static_cast<const char*>(base) +
                                                              16 * p.M * 2, 1);
        _mm512_storeu_si512(p.a_pad + m * p.Kp + k, _mm512_permutex2var_epi16(lo, even, hi));
        _mm512_storeu_si512(p.a_pad + (m + 1) * p.Kp + k,
                            _mm512_permutex2var_epi16(lo, odd, hi));
      }
    }
    for (; k < p.K; ++k) {
      for (int64_t m = m0; m < paired; ++m) p.a_pad[m * p.Kp + k] = p.a[k * p.M + m];
    }
  }
  for (int64_t k = 0; k < p.K; ++k) {
    for (int64_t m = paired; m < mv; ++m) p.a_pad[m * p.Kp + k] = p.a[k * p.M + m];
  }
}

// Tiles of 16 columns [nt0, nt1) of the packed op(B).
BA_AMX void PackB(const Plan& p, int64_t nt0, int64_t nt1) {
  const int64_t kt = p.Kp / kTileK;
  // b [K, N]: rows k and k + 1, 16 columns each, interleaved by one permutation.
  const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25,
                                         9, 24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2,
                                         17, 1, 16, 0);
  // b [N, K]: a tile row is 16 pairs (b[n, k], b[n, k + 1]), one from each of 16 rows n.
  const bool gather = p.tb && p.K % 2 == 0 && p.K * 2 * 16 < (int64_t{1} << 31);
  const __m512i cols16 = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7,
                                                             6, 5, 4, 3, 2, 1, 0),
                                            _mm512_set1_epi32(static_cast<int>(p.K * 2)));
  // k outside the column tiles: each pass reads a row pair of b once, over all the unit's
  // columns (a strip at a time would walk all K rows of b, one page each, per strip).
  for (int64_t kb = 0; kb < kt; ++kb) {
    for (int64_t r = 0; r < kTile; ++r) {
      const int64_t k = kb * kTileK + 2 * r;
      for (int64_t nt = nt0; nt < nt1; ++nt) {
        const bool full_n = (nt + 1) * kTile <= p.N;
        uint16_t* t = p.b_pack + (nt * kt + kb) * (kTile * kTileK);
        if (full_n && k + 1 < p.K && !p.tb) {
          const __m256i r0 = _mm256_loadu_si256(
              reinterpret_cast<const __m256i*>(p.b + k * p.N + nt * kTile));
          const __m256i r1 = _mm256_loadu_si256(
              reinterpret_cast<const __m256i*>(p.b + (k + 1) * p.N + nt * kTile));
          const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(r0), r1, 1);
          _mm512_storeu_si512(t + r * kTileK, _mm512_permutexvar_epi16(pairs, both));
          continue;
        }
        if (full_n && k + 1 < p.K && gather) {
          _mm512_storeu_si512(t + r * kTileK,
                              _mm512_i32gather_epi32(cols16, p.b + nt * kTile * p.K + k, 1));
          continue;
        }
        for (int64_t c = 0; c < kTile; ++c) {
          const int64_t n = nt * kTile + c;
          const bool in_n = n < p.N;
          t[r * kTileK + 2 * c] = in_n && k < p.K ? OpB(p, k, n) : 0;
          t[r * kTileK + 2 * c + 1] = in_n && k + 1 < p.K ? OpB(p, k + 1, n) : 0;
        }
      }
    }
  }
}

// Stores the 32 x 32 float32 block held in tiles 0-3 at dst, rows ld floats apart.
BA_AMX inline void StoreBlock(float* dst, int64_t ld) {
  const int64_t stride = ld * sizeof(float);
  _tile_stored(0, dst, stride);
  _tile_stored(1, dst + kTile, stride);
  _tile_stored(2, dst + kTile * ld, stride);
  _tile_stored(3, dst + kTile * ld + kTile, stride);
}

// Rounds one 32 x 32 block of C (tiles 0-3) to bfloat16 and stores its valid part.
BA_AMX void StoreBf16(const Plan& p, int64_t m, int64_t n, float* edge) {
  StoreBlock(edge, kBlock);
  const int64_t rows = std::min(kBlock, p.M - m), cols = std::min(kBlock, p.N - n);
  const __mmask32 keep = cols == kBlock ? ~__mmask32{0} : (__mmask32{1} << cols) - 1;
  const __m512i round = _mm512_set1_epi32(0x7fff), one = _mm512_set1_epi32(1);
  const __m512i abs = _mm512_set1_epi32(0x7fffffff), inf = _mm512_set1_epi32(0x7f800000);
  for (int64_t i = 0; i < rows; ++i) {
    __m512i half[2];
    for (int h = 0; h < 2; ++h) {
      const __m512i u = _mm512_load_si512(edge + i * kBlock + h * kTile);
      const __m512i bias = _mm512_add_epi32(round, _mm512_and_si512(_mm512_srli_epi32(u, 16), one));
      const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, abs), inf);
      // NaN keeps its sign and top mantissa bits, made quiet (bit 6 of the bf16 mantissa)
      const __m512i quiet = _mm512_or_si512(u, _mm512_set1_epi32(0x00400000));
      half[h] = _mm512_srli_epi32(_mm512_mask_mov_epi32(_mm512_add_epi32(u, bias), nan, quiet), 16);
    }
    const __m512i packed = _mm512_permutex2var_epi16(
        half[0],
        _mm512_set_epi16(62, 60, 58, 56, 54, 52, 50, 48, 46, 44, 42, 40, 38, 36, 34, 32, 30, 28,
                         26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0),
        half[1]);
    _mm512_mask_storeu_epi16(p.c_bf16 + (m + i) * p.N + n, keep, packed);
  }
}

// C rows [m0, m1) x columns [n0, n1), all multiples of kBlock within the padded sizes.
BA_AMX void Compute(const Plan& p, int64_t m0, int64_t m1, int64_t n0, int64_t n1) {
  ConfigureTiles();
  const int64_t kt = p.Kp / kTileK;
  const int64_t lda = p.Kp * sizeof(uint16_t);
  alignas(64) float edge[kBlock * kBlock];
  for (int64_t m = m0; m < m1; m += kBlock) {
    const uint16_t* a0 = p.a_rows + m * p.Kp;
    const uint16_t* a1 = a0 + kTile * p.Kp;
    for (int64_t n = n0; n < n1; n += kBlock) {
      const uint16_t* b0 = p.b_pack + (n / kTile) * kt * (kTile * kTileK);
      const uint16_t* b1 = b0 + kt * (kTile * kTileK);
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t kb = 0; kb < kt; ++kb) {
        _tile_loadd(4, a0 + kb * kTileK, lda);
        _tile_loadd(5, a1 + kb * kTileK, lda);
        _tile_loadd(6, b0 + kb * (kTile * kTileK), 64);
        _tile_loadd(7, b1 + kb * (kTile * kTileK), 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
      if (p.c_bf16 != nullptr) {
        StoreBf16(p, m, n, edge);
      } else if (m + kBlock <= p.M && n + kBlock <= p.N) {
        StoreBlock(p.c + m * p.N + n, p.N);
      } else {
        StoreBlock(edge, kBlock);
        const int64_t rows = std::min(kBlock, p.M - m), cols = std::min(kBlock, p.N - n);
        for (int64_t i = 0; i < rows; ++i) {
          std::memcpy(p.c + (m + i) * p.N + n, edge + i * kBlock, cols * sizeof(float));
        }
      }
    }
  }
  _tile_release();
}

// Scratch buffers kept between calls. A step of the training model makes ~150 products,
// each packing ~1-6 MB; allocated afresh, glibc hands most of them back to the OS on free
// and the next call page-faults them in again (~140,000 minor faults per bf16 train step
// of the benchmark model, the kernels' scratch among them). A call takes the smallest free
// buffer that fits (or allocates one) and returns it when its last unit finishes; at most
// kKeep buffers and kKeepBytes are kept (the smallest are freed first).
class ScratchPool {
 public:
  static std::shared_ptr<uint16_t[]> Get(int64_t elems) {
    elems = std::max<int64_t>(elems, 1);
    uint16_t* buf = nullptr;
    int64_t size = 0;
    {
      std::lock_guard<std::mutex> lock(mu());
      auto& free = buffers();
      auto best = free.end();
      for (auto it = free.begin(); it != free.end(); ++it) {
        if (it->first >= elems && (best == free.end() || it->first < best->first)) best = it;
      }
      if (best != free.end()) {
        size = best->first;
        buf = best->second;
        free.erase(best);
      }
    }
    if (buf == nullptr) {
      size = elems;
      buf = new (std::align_val_t(64)) uint16_t[size];
    }
    return std::shared_ptr<uint16_t[]>(buf, [size](uint16_t* x) { Put(size, x); });
  }

 private:
  static constexpr size_t kKeep = 8;
  static constexpr int64_t kKeepBytes = int64_t{256} << 20;
  static void Put(int64_t size, uint16_t* buf) {
    std::lock_guard<std::mutex> lock(mu());
    auto& free = buffers();
    free.emplace_back(size, buf);
    auto bytes = [&] {
      int64_t total = 0;
      for (const auto& f : free) total += f.first * int64_t{sizeof(uint16_t)};
      return total;
    };
    while (!free.empty() && (free.size() > kKeep || bytes() > kKeepBytes)) {
      auto small = std::min_element(free.begin(), free.end());
      ::operator delete[](small->second, std::align_val_t(64));
      free.erase(small);
    }
  }
  static std::mutex& mu() {
    static std::mutex m;
    return m;
  }
  static std::vector<std::pair<int64_t, uint16_t*>>& buffers() {
    static auto* b = new std::vector<std::pair<int64_t, uint16_t*>>();  // never destroyed
    return *b;
  }
};

// Allocates the scratch p needs (a padded copy of op(A) unless a is used in place, and the
// packed op(B) when pack_b; otherwise p.b_pack is already set) and computes C over the
// calling thread and the pool.
ffi::Error Run(ffi::ThreadPool& pool, Plan p, bool pack_b) {
  if (p.M == 0 || p.N == 0) return ffi::Error::Success();
  const bool a_in_place = !p.ta && p.M == p.Mp && p.K == p.Kp;
  // One allocation holds both scratch arrays; it lives until every unit has finished.
  const int64_t a_elems = a_in_place ? 0 : p.Mp * p.Kp;
  const int64_t b_elems = pack_b ? p.Np * p.Kp : 0;
  auto scratch = ScratchPool::Get(a_elems + b_elems);
  p.a_pad = a_in_place ? nullptr : scratch.get();
  p.a_rows = a_in_place ? p.a : p.a_pad;
  if (pack_b) p.b_pack = scratch.get() + a_elems;

  // Packing units: 64-row slices of A, 64-column slices of B. Compute units: panels.
  const int64_t a_units = a_in_place ? 0 : (p.Mp + 63) / 64;
  const int64_t b_units = pack_b ? (p.Np / kTile + 3) / 4 : 0;
  const int64_t pack_units = a_units + b_units;
  const int64_t m_panels = (p.Mp + kPanelM - 1) / kPanelM;
  const int64_t n_panels = (p.Np + kPanelN - 1) / kPanelN;
  const int64_t units = pack_units + m_panels * n_panels;
  auto packed = std::make_shared<std::atomic<int64_t>>(0);
  // scratch is captured so that it outlives a helper that starts after the last unit
  ba_native::ParallelFor(pool, units, [=](int64_t i) {
    (void)scratch;
    if (i < a_units) {
      PadA(p, i * 64, std::min(p.Mp, (i + 1) * 64));
      packed->fetch_add(1);
    } else if (i < pack_units) {
      const int64_t j = i - a_units;
      PackB(p, j * 4, std::min(p.Np / kTile, (j + 1) * 4));
      packed->fetch_add(1);
    } else {
      // Every packing unit was claimed before this one; wait for those still running.
      while (packed->load(std::memory_order_acquire) < pack_units) std::this_thread::yield();
      const int64_t j = i - pack_units;
      const int64_t mi = j % m_panels, ni = j / m_panels;  // a B panel's units adjacent
      Compute(p, mi * kPanelM, std::min(p.Mp, (mi + 1) * kPanelM), ni * kPanelN,
              std::min(p.Np, (ni + 1) * kPanelN));
    }
  });
  return ffi::Error::Success();
}

int64_t PadToBlock(int64_t x) { return (x + kBlock - 1) / kBlock * kBlock; }

// Fills p's sizes and operand pointers from a ([M, K], or [K, M] when ta) and C.
ffi::Error PlanA(Plan& p, ffi::AnyBuffer a, ffi::Result<ffi::AnyBuffer>& out, bool ta) {
  if (!AmxReady()) return ffi::Error::InvalidArgument("AMX-BF16 is not available");
  const auto ad = a.dimensions(), cd = out->dimensions();
  if (a.element_type() != ffi::BF16 || ad.size() != 2 || cd.size() != 2) {
    return ffi::Error::InvalidArgument("ba_matmul_amx takes a 2-D bfloat16 left operand");
  }
  p.ta = ta;
  p.M = ta ? ad[1] : ad[0];
  p.K = ta ? ad[0] : ad[1];
  p.N = cd[1];
  if (cd[0] != p.M) return ffi::Error::InvalidArgument("ba_matmul_amx: rows do not match");
  p.Mp = PadToBlock(p.M);
  p.Kp = PadToBlock(p.K);
  p.Np = PadToBlock(p.N);
  p.a = reinterpret_cast<const uint16_t*>(a.untyped_data());
  if (out->element_type() == ffi::F32) {
    p.c = reinterpret_cast<float*>(out->untyped_data());
    p.c_bf16 = nullptr;
  } else if (out->element_type() == ffi::BF16) {
    p.c = nullptr;
    p.c_bf16 = reinterpret_cast<uint16_t*>(out->untyped_data());
  } else {
    return ffi::Error::InvalidArgument("ba_matmul_amx returns float32 or bfloat16");
  }
  return ffi::Error::Success();
}

ffi::Error Matmul(ffi::ThreadPool pool, ffi::AnyBuffer a, ffi::AnyBuffer b,
                  ffi::Result<ffi::AnyBuffer> out, bool transpose_a, bool transpose_b) {
  Plan p;
  if (auto err = PlanA(p, a, out, transpose_a); err.failure()) return err;
  const auto bd = b.dimensions();
  if (b.element_type() != ffi::BF16 || bd.size() != 2) {
    return ffi::Error::InvalidArgument("ba_matmul_amx takes a 2-D bfloat16 right operand");
  }
  p.tb = transpose_b;
  if ((transpose_b ? bd[1] : bd[0]) != p.K || (transpose_b ? bd[0] : bd[1]) != p.N) {
    return ffi::Error::InvalidArgument("ba_matmul_amx: operand shapes do not match");
  }
  p.b = reinterpret_cast<const uint16_t*>(b.untyped_data());
  return Run(pool, p, /*pack_b=*/true);
}

// op(B) packed once into the layout Compute reads, for products that reuse one weight over
// many calls (the decode steps): out is [Np / 16, Kp / 32, 512] bf16.
ffi::Error PackWeight(ffi::AnyBuffer b, ffi::Result<ffi::AnyBuffer> out, bool transpose_b) {
  const auto bd = b.dimensions(), od = out->dimensions();
  if (b.element_type() != ffi::BF16 || out->element_type() != ffi::BF16 || bd.size() != 2) {
    return ffi::Error::InvalidArgument("ba_pack_amx takes a 2-D bfloat16 operand");
  }
  Plan p;
  p.tb = transpose_b;
  p.K = transpose_b ? bd[1] : bd[0];
  p.N = transpose_b ? bd[0] : bd[1];
  p.Kp = PadToBlock(p.K);
  p.Np = PadToBlock(p.N);
  if (od.size() != 3 || od[0] != p.Np / kTile || od[1] != p.Kp / kTileK ||
      od[2] != kTile * kTileK) {
    return ffi::Error::InvalidArgument("ba_pack_amx: wrong packed shape");
  }
  p.b = reinterpret_cast<const uint16_t*>(b.untyped_data());
  p.b_pack = reinterpret_cast<uint16_t*>(out->untyped_data());
  PackB(p, 0, p.Np / kTile);
  return ffi::Error::Success();
}

// C = op(A) @ B with B packed by PackWeight.
ffi::Error MatmulPacked(ffi::ThreadPool pool, ffi::AnyBuffer a, ffi::AnyBuffer b_pack,
                        ffi::Result<ffi::AnyBuffer> out, bool transpose_a) {
  Plan p;
  if (auto err = PlanA(p, a, out, transpose_a); err.failure()) return err;
  const auto bd = b_pack.dimensions();
  if (b_pack.element_type() != ffi::BF16 || bd.size() != 3 || bd[0] != p.Np / kTile ||
      bd[1] != p.Kp / kTileK || bd[2] != kTile * kTileK) {
    return ffi::Error::InvalidArgument("ba_matmul_amx_packed: packed operand does not match");
  }
  p.tb = false;
  p.b = nullptr;
  p.b_pack = reinterpret_cast<uint16_t*>(b_pack.untyped_data());
  return Run(pool, p, /*pack_b=*/false);
}

}  // namespace

extern "C" int BaAmxAvailable() { return AmxReady() ? 1 : 0; }

XLA_FFI_DEFINE_HANDLER_SYMBOL(BaMatmulAmx, Matmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<bool>("transpose_a")
                                  .Attr<bool>("transpose_b"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(BaPackAmx, PackWeight,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<bool>("transpose_b"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(BaMatmulAmxPacked, MatmulPacked,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<bool>("transpose_a"));
