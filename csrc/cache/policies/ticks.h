// The clock ticks that lru and fifo key on (Header::clock, ticks[]): writers advance the clock on
// every insert, mutex held (relaxed: only writers order by it, and they hold the mutex).
#pragma once

#include "cache/policy.h"

namespace shadecache {

inline double next_tick(const PolicyState& s) {
  return static_cast<double>(s.clock->fetch_add(1, std::memory_order_relaxed) + 1);
}
inline void store_tick(const PolicyState& s, uint32_t id, double key) {
  s.ticks[id].store(static_cast<uint64_t>(key), std::memory_order_relaxed);
}
inline double tick_of(const PolicyState& s, uint32_t id) {
  return static_cast<double>(s.ticks[id].load(std::memory_order_relaxed));
}

}  // namespace shadecache
