#include "io/store_format.h"

namespace shadecache {
namespace store {

std::vector<uint64_t> placement_order(uint64_t n, uint64_t seed) {
  std::vector<uint64_t> order(n);
  for (uint64_t i = 0; i < n; ++i) order[i] = i;
  uint64_t state = seed;
  auto next = [&state]() {  // splitmix64 (Steele, Lea, Flood 2014)
    uint64_t z = (state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  };
  for (uint64_t i = n; i-- > 1;) {
    uint64_t j = static_cast<uint64_t>((static_cast<unsigned __int128>(next()) * (i + 1)) >> 64);
    uint64_t t = order[i];
    order[i] = order[j];
    order[j] = t;
  }
  return order;
}

}  // namespace store
}  // namespace shadecache
