// lru: the key is the last access tick. Writers tick on insert and rewrite; readers stamp hits
// with the clock's current value, without the lock, so a heap key may lag its tick: eviction
// refreshes the top before it takes it (current_key).
#include <string>

#include "cache/policies/ticks.h"

namespace shadecache {
namespace {

struct LruPolicy final : EvictionPolicy {
  Policy id() const override { return Policy::kLru; }
  const char* name() const override { return "lru"; }
  bool uses_ticks() const override { return true; }
  bool stamps_hits() const override { return true; }
  bool rekey_on_rewrite() const override { return true; }
  double insert_key(const PolicyState& s, uint32_t) const override { return next_tick(s); }
  void on_insert(const PolicyState& s, uint32_t id, double key) const override { store_tick(s, id, key); }
  double current_key(const PolicyState& s, uint32_t id, double key) const override {
    double t = tick_of(s, id);
    return t > key ? t : key;
  }
  double repair_key(const PolicyState& s, uint32_t id) const override { return tick_of(s, id); }
  std::string check_key(const PolicyState& s, uint32_t, double key) const override {
    // Not "key <= tick": a reader stamps a hit with a plain load-then-store of the clock (no
    // read-modify-write on the hot path), so it may leave an older stamp over a writer's newer
    // one. Eviction only ever raises a key to the stamp; the clock bounds both.
    if (key > static_cast<double>(s.clock->load(std::memory_order_relaxed))) return "has a heap key newer than the clock";
    return "";
  }
};

const LruPolicy kPolicy;
const PolicyRegistration kRegistered(&kPolicy);

}  // namespace
}  // namespace shadecache
