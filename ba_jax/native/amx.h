// Intel AMX helpers shared by the tile kernels (matmul_amx.cc, attention_amx.cc).
#pragma once

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>

// Functions using tile instructions are compiled for AMX whatever -march says; Python calls
// them only after AmxReady() (the processor has AMX-BF16 and the OS granted the tile state).
#define BA_AMX __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx2")))

namespace ba_amx {

inline bool RequestTileData() {
  unsigned eax, ebx, ecx, edx;
  __asm__("cpuid" : "=a"(eax), "=b"(ebx), "=c"(ecx), "=d"(edx) : "a"(0), "c"(0));
  if (eax < 7) return false;
  __asm__("cpuid" : "=a"(eax), "=b"(ebx), "=c"(ecx), "=d"(edx) : "a"(7), "c"(0));
  const bool amx_bf16 = (edx >> 22) & 1, amx_tile = (edx >> 24) & 1;
  const bool avx512bw = (ebx >> 30) & 1;
  if (!amx_bf16 || !amx_tile || !avx512bw) return false;
  constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
}

// Whether the tile unit can be used: asked once per process (the permission is per process).
inline bool AmxReady() {
  static const bool ok = RequestTileData();
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// All 8 tiles as 16 rows of 64 bytes (16 x 32 bf16, or 16 x 16 float32), on this thread
// until _tile_release().
BA_AMX inline void ConfigureTiles() {
  TileConfig c;
  std::memset(&c, 0, sizeof c);
  c.palette_id = 1;
  for (int i = 0; i < 8; ++i) {
    c.rows[i] = 16;
    c.colsb[i] = 64;
  }
  _tile_loadconfig(&c);
}

}  // namespace ba_amx
