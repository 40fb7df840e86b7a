// fifo: the key is the insert tick; hits and rewrites in place do not change it.
#include <string>

#include "cache/policies/ticks.h"

namespace shadecache {
namespace {

struct FifoPolicy final : EvictionPolicy {
  Policy id() const override { return Policy::kFifo; }
  const char* name() const override { return "fifo"; }
  bool uses_ticks() const override { return true; }
  double insert_key(const PolicyState& s, uint32_t) const override { return next_tick(s); }
  void on_insert(const PolicyState& s, uint32_t id, double key) const override { store_tick(s, id, key); }
  double repair_key(const PolicyState& s, uint32_t id) const override { return tick_of(s, id); }
  std::string check_key(const PolicyState& s, uint32_t id, double key) const override {
    return key == tick_of(s, id) ? "" : "has a heap key that is not its insert tick";
  }
};

const FifoPolicy kPolicy;
const PolicyRegistration kRegistered(&kPolicy);

}  // namespace
}  // namespace shadecache
