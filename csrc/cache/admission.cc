// The engine's answer to "would these values be admitted?", asked by readers that decide ahead of
// a put (the prefetcher reads a sample only if the cache would keep it when it is due). The
// answer comes from the same policy object that decides a put (EvictionPolicy::admits), so no
// caller carries a copy of a policy's rule.
#include <algorithm>
#include <limits>

#include "cache/cache.h"

namespace shadecache {

void Cache::would_admit(const int64_t* ids, const int64_t* displaced, size_t n, uint8_t* out) {
  Use use(*this);
  for (size_t i = 0; i < n; ++i) {
    check_id_signed(ids[i]);
    if (displaced[i] < 0)
      throw Error(ErrorKind::kInvalidArgument, "displaced must be >= 0, got " + std::to_string(displaced[i]));
  }
  if (!policy_->evicts()) {  // a full cache of this policy makes no room at all
    std::fill(out, out + n, 0);
    return;
  }
  std::vector<double> keys;
  {
    WriteLock lock(this);
    keys.reserve(heap_.size());
    for (uint64_t k = 0; k < heap_.size(); ++k) keys.push_back(heap_.key_at(k));
  }
  // Only the lowest max(displaced) + 1 keys are asked for: those in order, the rest left as they
  // are (a sort of every key of a large cache per call cost far more than the copy).
  uint64_t want = 0;
  for (size_t i = 0; i < n; ++i) want = std::max<uint64_t>(want, static_cast<uint64_t>(displaced[i]) + 1);
  if (want < keys.size()) {
    std::nth_element(keys.begin(), keys.begin() + want, keys.end());
    keys.resize(want);
  }
  std::sort(keys.begin(), keys.end());
  constexpr double kNoneLeft = std::numeric_limits<double>::infinity();
  for (size_t i = 0; i < n; ++i) {
    uint32_t id = static_cast<uint32_t>(ids[i]);
    // The key `id` would enter with, from its per-id state: repair_key is that pure function
    // (insert_key may advance the clock). Once `displaced[i]` values have given way, the lowest
    // key left is the next one in order; with none left the policy compares against +inf.
    uint64_t k = static_cast<uint64_t>(displaced[i]);
    double lowest = k < keys.size() ? keys[k] : kNoneLeft;
    out[i] = policy_->admits(policy_->repair_key(pstate_, id), lowest);
  }
}

}  // namespace shadecache
