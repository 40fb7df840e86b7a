// Eviction policies. Each policy is one small type in csrc/cache/policies/ that answers the
// questions the engine asks of it; adding a policy is a new Policy number (layout.h), one file
// there, and its test. The engine keeps one indexed min-heap over a key per cached value and
// evicts the smallest; a policy decides the keys, when they change, and whether a value may enter.
//
// Every method runs with the cache mutex held (writers, repair, check), except that a policy
// with stamps_hits() has readers store ticks[id] = clock without any lock (Cache::note_hit).
#pragma once

#include <atomic>
#include <cstdint>
#include <string>
#include <vector>

#include "cache/layout.h"

namespace shadecache {

// The per-id state in the segment that policies key on.
struct PolicyState {
  std::atomic<float>* scores;   // importance of every id (cached or not)
  std::atomic<uint64_t>* ticks;  // per id, only when uses_ticks(); else nullptr
  std::atomic<uint64_t>* clock;  // advanced by writers on every insert (Header::clock)
  const double* weight;          // Header::policy_weight (clairvoyant's blend), mutex held to read
};

class EvictionPolicy {
 public:
  virtual ~EvictionPolicy() = default;
  virtual Policy id() const = 0;
  virtual const char* name() const = 0;
  // The segment keeps a tick per id for this policy (ticks[]).
  virtual bool uses_ticks() const { return false; }
  // Readers stamp hits: ticks[id] = clock (relaxed, no lock; see Cache::note_hit).
  virtual bool stamps_hits() const { return false; }
  // Score updates move the key of a cached value: it is rekeyed to insert_key(), which for such
  // a policy is a pure function of the per-id state (it advances no clock).
  virtual bool keyed_by_score() const { return false; }
  // Full cache: no value is evicted to make room (static).
  virtual bool evicts() const { return true; }
  // ticks[id] holds the next position at which the node reads id (Cache::set_next_use).
  virtual bool keys_on_next_use() const { return false; }

  // The key a value of `id` about to be written gets. It may advance the clock, but changes no
  // state of `id` itself: a put that is then refused must leave `id` as it was. on_insert records
  // the key once the value is in (published or rewritten in place).
  virtual double insert_key(const PolicyState& s, uint32_t id) const = 0;
  virtual void on_insert(const PolicyState& s, uint32_t id, double key) const {}
  // A rewrite in place of a cached value takes a new key (lru: a put is an access).
  virtual bool rekey_on_rewrite() const { return false; }
  // A full cache admits a value of key `key` in place of the lowest `lowest` (importance: only
  // when it beats it). Called only when the cache is full.
  virtual bool admits(double key, double lowest) const { return true; }
  // The key of a heap top whose key readers may have moved since (lru: their hit stamps); equal
  // to `key` when nothing moved it. A larger one is applied and the top looked at again.
  virtual double current_key(const PolicyState& s, uint32_t id, double key) const { return key; }
  // The key repair gives a live value, from the per-id state the segment keeps.
  virtual double repair_key(const PolicyState& s, uint32_t id) const = 0;
  // "" when `key` is a key this policy could have given cached `id`; else what is wrong.
  virtual std::string check_key(const PolicyState& s, uint32_t id, double key) const = 0;
};

// Next-use positions (Cache::set_next_use) are below this: 2^39, far beyond any job's reads.
constexpr int64_t kMaxNextUsePosition = int64_t{1} << 39;

// The policy stored in a header, nullptr for an unknown number.
const EvictionPolicy* policy_by_id(uint32_t id);
// Names of every policy, indexed by Policy number (exported to Python as POLICIES).
std::vector<std::string> policy_names();

// Each policy file registers its type with one static instance of this.
struct PolicyRegistration {
  explicit PolicyRegistration(const EvictionPolicy* p);
};

}  // namespace shadecache
