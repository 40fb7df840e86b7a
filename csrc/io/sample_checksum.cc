#include "io/sample_checksum.h"

#include <cstring>

#include "common/crc32c.h"

#if defined(__x86_64__)
#include <nmmintrin.h>
#endif

namespace shadecache {

#if defined(__x86_64__)
namespace {

constexpr size_t kLane = 512;  // bytes per stream per round; each round covers 3 * kLane

// The raw CRC state (no pre/post inversion) is linear over GF(2) in (state, data), so
//   crc(s, A || B) = zeros(crc(s, A), |B|) ^ crc(0, B)
// where zeros(x, k) is the state x advanced over k zero bytes. zeros(., kLane) is linear in x
// and is applied a byte of x at a time from a 4 x 256 table.
struct Zeros {
  uint32_t t[4][256];
  Zeros() {
    for (int b = 0; b < 4; ++b)
      for (uint32_t v = 0; v < 256; ++v) t[b][v] = advance(v << (8 * b));
  }
  __attribute__((target("sse4.2"))) static uint32_t advance(uint32_t x) {
    uint64_t c = x;
    for (size_t i = 0; i < kLane / 8; ++i) c = _mm_crc32_u64(c, 0);
    return static_cast<uint32_t>(c);
  }
  uint32_t apply(uint32_t x) const {
    return t[0][x & 0xFF] ^ t[1][(x >> 8) & 0xFF] ^ t[2][(x >> 16) & 0xFF] ^ t[3][x >> 24];
  }
};

__attribute__((target("sse4.2"))) uint32_t raw3(uint32_t state, const uint8_t* p, size_t n) {
  static const Zeros zeros;
  while (n >= 3 * kLane) {
    uint64_t a = state, b = 0, c = 0;
    for (size_t i = 0; i < kLane; i += 8) {
      uint64_t x, y, z;
      std::memcpy(&x, p + i, 8);
      std::memcpy(&y, p + kLane + i, 8);
      std::memcpy(&z, p + 2 * kLane + i, 8);
      a = _mm_crc32_u64(a, x);
      b = _mm_crc32_u64(b, y);
      c = _mm_crc32_u64(c, z);
    }
    state = zeros.apply(zeros.apply(static_cast<uint32_t>(a)) ^ static_cast<uint32_t>(b)) ^
            static_cast<uint32_t>(c);
    p += 3 * kLane;
    n -= 3 * kLane;
  }
  uint64_t s = state;
  for (; n >= 8; n -= 8, p += 8) {
    uint64_t x;
    std::memcpy(&x, p, 8);
    s = _mm_crc32_u64(s, x);
  }
  uint32_t s32 = static_cast<uint32_t>(s);
  while (n--) s32 = _mm_crc32_u8(s32, *p++);
  return s32;
}

}  // namespace
#endif

uint32_t sample_crc32c(const void* data, size_t n) {
#if defined(__x86_64__)
  static const bool hw = __builtin_cpu_supports("sse4.2");
  if (hw && n >= 3 * kLane) return ~raw3(~0u, static_cast<const uint8_t*>(data), n);
#endif
  return crc32c(data, n);
}

}  // namespace shadecache
