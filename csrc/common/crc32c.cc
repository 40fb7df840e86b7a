#include "common/crc32c.h"

#include <cstring>

#if defined(__x86_64__)
#include <nmmintrin.h>
#endif

namespace shadecache {
namespace {

constexpr uint32_t kPoly = 0x82F63B78u;  // reflected Castagnoli polynomial

struct Table {
  uint32_t t[256];
  Table() {
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c >> 1) ^ (kPoly & (0u - (c & 1u)));
      t[i] = c;
    }
  }
};

uint32_t crc_soft(const uint8_t* p, size_t n, uint32_t crc) {
  static const Table table;
  while (n--) crc = table.t[(crc ^ *p++) & 0xFF] ^ (crc >> 8);
  return crc;
}

#if defined(__x86_64__)
// One dependency chain: 8 bytes per crc32 instruction, which has a 3-cycle latency.
__attribute__((target("sse4.2"))) uint32_t crc_hw(const uint8_t* p, size_t n, uint32_t crc) {
  uint64_t c = crc;
  while (n >= 8) {
    uint64_t v;
    std::memcpy(&v, p, 8);
    c = _mm_crc32_u64(c, v);
    p += 8;
    n -= 8;
  }
  uint32_t c32 = static_cast<uint32_t>(c);
  while (n--) c32 = _mm_crc32_u8(c32, *p++);
  return c32;
}

// Three interleaved chains keep the crc32 unit busy (latency 3, throughput 1): ~2.5x faster on
// large inputs, which matters because every stored sample and every cached value is checksummed.
// The raw CRC state (no pre/post inversion) is linear over GF(2), so
//   crc(s, A || B) = zeros(crc(s, A), |B|) ^ crc(0, B)
// where zeros(x, k) advances state x over k zero bytes; zeros(., lane) is linear in x and is
// applied a byte of x at a time from a 4 x 256 table. Rounds of 3 x 512 bytes, then of 3 x 64 for
// what is left (a 3 KB value would otherwise spend half its time in one chain).
constexpr size_t kLane = 512;      // bytes per chain per round; a round covers 3 * kLane
constexpr size_t kShortLane = 64;  // the same for the rest

template <size_t Lane>
struct Zeros {
  uint32_t t[4][256];
  Zeros() {
    for (int b = 0; b < 4; ++b)
      for (uint32_t v = 0; v < 256; ++v) t[b][v] = advance(v << (8 * b));
  }
  __attribute__((target("sse4.2"))) static uint32_t advance(uint32_t x) {
    uint64_t c = x;
    for (size_t i = 0; i < Lane / 8; ++i) c = _mm_crc32_u64(c, 0);
    return static_cast<uint32_t>(c);
  }
  uint32_t apply(uint32_t x) const {
    return t[0][x & 0xFF] ^ t[1][(x >> 8) & 0xFF] ^ t[2][(x >> 16) & 0xFF] ^ t[3][x >> 24];
  }
};

// Rounds of three chains of Lane bytes each while n allows; advances p and n.
template <size_t Lane>
__attribute__((target("sse4.2"))) uint32_t crc_rounds(const uint8_t*& p, size_t& n, uint32_t state) {
  static const Zeros<Lane> zeros;
  while (n >= 3 * Lane) {
    uint64_t a = state, b = 0, c = 0;
    for (size_t i = 0; i < Lane; i += 8) {
      uint64_t x, y, z;
      std::memcpy(&x, p + i, 8);
      std::memcpy(&y, p + Lane + i, 8);
      std::memcpy(&z, p + 2 * Lane + i, 8);
      a = _mm_crc32_u64(a, x);
      b = _mm_crc32_u64(b, y);
      c = _mm_crc32_u64(c, z);
    }
    state = zeros.apply(zeros.apply(static_cast<uint32_t>(a)) ^ static_cast<uint32_t>(b)) ^
            static_cast<uint32_t>(c);
    p += 3 * Lane;
    n -= 3 * Lane;
  }
  return state;
}

__attribute__((target("sse4.2"))) uint32_t crc_hw3(const uint8_t* p, size_t n, uint32_t state) {
  state = crc_rounds<kLane>(p, n, state);
  state = crc_rounds<kShortLane>(p, n, state);
  return crc_hw(p, n, state);
}
#endif

bool cpu_has_sse42() {
#if defined(__x86_64__)
  return __builtin_cpu_supports("sse4.2");
#else
  return false;
#endif
}

}  // namespace

uint32_t crc32c(const void* data, size_t n, uint32_t seed) {
  static const bool hw = cpu_has_sse42();
  const auto* p = static_cast<const uint8_t*>(data);
  uint32_t crc = ~seed;
#if defined(__x86_64__)
  if (hw) return ~(n >= 3 * kShortLane ? crc_hw3(p, n, crc) : crc_hw(p, n, crc));
#endif
  return ~crc_soft(p, n, crc);
}

uint32_t crc32c_serial(const void* data, size_t n, uint32_t seed) {
  static const bool hw = cpu_has_sse42();
  const auto* p = static_cast<const uint8_t*>(data);
#if defined(__x86_64__)
  if (hw) return ~crc_hw(p, n, ~seed);
#endif
  return ~crc_soft(p, n, ~seed);
}

}  // namespace shadecache
