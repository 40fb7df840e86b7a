// The clairvoyant policy's inputs: next-use positions and the blend weight. Both are written
// here only, with the mutex held, and every cached value they concern is rekeyed in the same
// critical section (the contract is in csrc/cache/policies/clairvoyant.cc).
#include "cache/cache.h"

#include <cmath>

namespace shadecache {

void Cache::set_next_use(const int64_t* ids, const int64_t* positions, size_t n) {
  Use use(*this);
  // The whole batch is checked before anything changes: a bad id or position loses nothing.
  for (size_t i = 0; i < n; ++i) {
    check_id_signed(ids[i]);
    if (positions[i] < -1 || positions[i] >= kMaxNextUsePosition)
      throw Error(ErrorKind::kInvalidArgument, "next-use position " + std::to_string(positions[i]) + " of sample id " +
                                                   std::to_string(ids[i]) + " is not in -1.." +
                                                   std::to_string(kMaxNextUsePosition - 1) + " (-1: none known)");
  }
  if (!policy_->keys_on_next_use()) return;  // lru, fifo, ...: nothing keys on it
  for (size_t i = 0; i < n; ++i) {  // scattered ids: issue the misses before the lock (update_scores)
    __builtin_prefetch(&ticks_[ids[i]], 1);
    __builtin_prefetch(&heap_pos_[ids[i]], 0);
  }
  WriteLock lock(this);
  for (size_t i = 0; i < n; ++i) {
    if (i == n / 2) crash_point(CrashPoint::kNextUseMid);
    uint32_t id = static_cast<uint32_t>(ids[i]);
    // A single relaxed store: a writer killed after it and before the rekey leaves a heap key
    // that repair (run by the next locker) recomputes from this very tick.
    ticks_[id].store(static_cast<uint64_t>(positions[i] + 1), std::memory_order_relaxed);
    if (heap_.contains(id)) do_rekey(id, policy_->insert_key(pstate_, id));
  }
}

void Cache::set_policy_weight(double w) {
  Use use(*this);
  if (!policy_->keys_on_next_use())
    throw Error(ErrorKind::kInvalidArgument, std::string("cache '") + name_ + "' uses the " + policy_->name() +
                                                 " policy; only clairvoyant has a blend weight");
  if (!std::isfinite(w) || w < 0)
    throw Error(ErrorKind::kInvalidArgument, "blend weight must be finite and >= 0, got " + std::to_string(w));
  WriteLock lock(this);
  hdr_->policy_weight = w;
  // Every cached value at once (rare: the user sets the blend once): heap nodes are rekeyed in
  // place over a snapshot of the ids, as a crash mid-way is repaired from ticks, scores and w.
  std::vector<uint32_t> ids;
  ids.reserve(hdr_->items);
  for (uint64_t id = 0; id < n_; ++id)
    if (heap_.contains(static_cast<uint32_t>(id))) ids.push_back(static_cast<uint32_t>(id));
  for (uint32_t id : ids) do_rekey(id, policy_->insert_key(pstate_, id));
}

double Cache::policy_weight() {
  Use use(*this);
  WriteLock lock(this);
  return hdr_->policy_weight;
}

}  // namespace shadecache
