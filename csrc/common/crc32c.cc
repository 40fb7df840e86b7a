#include "common/crc32c.h"

#include <cstring>

#if defined(__x86_64__)
#include <nmmintrin.h>
#include <wmmintrin.h>
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

// Three interleaved chains keep the crc32 unit busy (latency 3, throughput 1): the input is cut
// into three lanes of a third each (a multiple of 8 bytes; the last < 24 bytes follow on one
// chain), each run on its own chain, then joined. The raw CRC state (no pre/post inversion) is
// linear over GF(2): crc(s, A || B) = shift(crc(s, A), |B|) ^ crc(0, B), where shift(x, k)
// advances state x over k zero bytes, i.e. multiplies it by x^(8k) mod P. A carry-less multiply
// by K = x^(8k - 33) mod P, reduced by one crc32 instruction, does that (the instruction's
// reduction multiplies by x^32 more, and the reflected product is one bit off: 33); K comes from
// the precomputed x^(8 * 2^j - 33) of the bits of k/8, a multiply each, and is kept for the
// next value of the same length. One join per value: the rounds of fixed lanes this replaces
// joined every 192 bytes, through tables, on the chain's critical path, which held values of a few
// KB back (docs/benchmark_history.md, "Batched pins, a faster crc32c, and the parts of a sealed
// GET").
constexpr size_t kMinLanes = 192;  // below this one chain (the join would cost more than it saves)
constexpr uint32_t kOne = 1u << 31;  // the polynomial 1 (reflected: bit 31 is x^0)

// a * b mod P, reflected, a bit at a time (only to build the table below).
uint32_t multiply_slow(uint32_t a, uint32_t b) {
  uint32_t m = kOne, prod = 0;
  for (; m; m >>= 1) {
    if (a & m) prod ^= b;
    b = b & 1 ? (b >> 1) ^ kPoly : b >> 1;
  }
  return prod;
}

uint32_t power_slow(uint64_t n) {  // x^n mod P
  uint32_t r = kOne, sq = kOne >> 1;  // x^0, x^1
  for (; n; n >>= 1) {
    if (n & 1) r = multiply_slow(sq, r);
    sq = multiply_slow(sq, sq);
  }
  return r;
}

// shift(x, k) for the K of k (see above).
__attribute__((target("sse4.2,pclmul"))) inline uint32_t shift_by(uint32_t x, uint32_t k) {
  __m128i prod = _mm_clmulepi64_si128(_mm_cvtsi32_si128(static_cast<int>(x)), _mm_cvtsi32_si128(static_cast<int>(k)), 0);
  return static_cast<uint32_t>(_mm_crc32_u64(0, static_cast<uint64_t>(_mm_cvtsi128_si64(prod))));
}

struct LaneShifts {
  uint32_t pow[40];  // pow[j] = x^(64 * 2^j - 33): the K of a lane of 8 * 2^j bytes
  LaneShifts() {
    for (int j = 0; j < 40; ++j) pow[j] = power_slow((uint64_t{64} << j) - 33);
  }
  // The K of a lane of `words` 8-byte words: x^(64 * words - 33), the product of pow[] over
  // the bits of words; each further factor is a shift_by (it multiplies by x^33 more, which
  // the -33 of the next factor takes back).
  __attribute__((target("sse4.2,pclmul"))) uint32_t of(uint64_t words) const {
    int j = __builtin_ctzll(words);
    uint32_t k = pow[j];
    for (words &= words - 1; words; words &= words - 1) k = shift_by(k, pow[__builtin_ctzll(words)]);
    return k;
  }
};

__attribute__((target("sse4.2,pclmul"))) uint32_t crc_hw3(const uint8_t* p, size_t n, uint32_t state) {
  static const LaneShifts shifts;
  thread_local uint64_t last_words = 0;  // values of a batch often share a length
  thread_local uint32_t last_k = 0;
  const size_t lane = n / 24 * 8, words = lane / 8;
  uint64_t a = state, b = 0, c = 0;
  const uint8_t* pb = p + lane;
  const uint8_t* pc = p + 2 * lane;
  for (size_t i = 0; i < lane; i += 8) {
    uint64_t x, y, z;
    std::memcpy(&x, p + i, 8);
    std::memcpy(&y, pb + i, 8);
    std::memcpy(&z, pc + i, 8);
    a = _mm_crc32_u64(a, x);
    b = _mm_crc32_u64(b, y);
    c = _mm_crc32_u64(c, z);
  }
  if (words != last_words) {
    last_k = shifts.of(words);
    last_words = words;
  }
  state = shift_by(shift_by(static_cast<uint32_t>(a), last_k) ^ static_cast<uint32_t>(b), last_k) ^
          static_cast<uint32_t>(c);
  return crc_hw(p + 3 * lane, n - 3 * lane, state);
}
#endif

// What the CPU offers the paths above (read once).
struct Cpu {
  bool sse42 = false;   // the crc32 instruction
  bool pclmul = false;  // the carry-less multiply that joins the three lanes
  Cpu() {
#if defined(__x86_64__)
    sse42 = __builtin_cpu_supports("sse4.2");
    pclmul = sse42 && __builtin_cpu_supports("pclmul");
#endif
  }
};

}  // namespace

uint32_t crc32c(const void* data, size_t n, uint32_t seed) {
  static const Cpu cpu;
  const auto* p = static_cast<const uint8_t*>(data);
  uint32_t crc = ~seed;
#if defined(__x86_64__)
  if (cpu.sse42) return ~(cpu.pclmul && n >= kMinLanes ? crc_hw3(p, n, crc) : crc_hw(p, n, crc));
#endif
  return ~crc_soft(p, n, crc);
}

uint32_t crc32c_serial(const void* data, size_t n, uint32_t seed) {
  static const Cpu cpu;
  const auto* p = static_cast<const uint8_t*>(data);
#if defined(__x86_64__)
  if (cpu.sse42) return ~crc_hw(p, n, ~seed);
#endif
  return ~crc_soft(p, n, ~seed);
}

}  // namespace shadecache
