// clairvoyant (Belady's MIN weighed with importance, as NoPFS keeps what is read soonest): the
// key of a value is how soon the node reads it next.
//
//   next read known at position P:  key = kKnown - P + clamp(w * score)     (soonest = highest)
//   no next read known:             key = clamp(score)                      (importance)
//
// Every key of the first kind is above every key of the second (kKnown - kMaxPosition -
// kBlendBound > kScoreBound), so the farthest next use is evicted first, then, once no cached
// value has a known next use left, the lowest score. w (Header::policy_weight, default 0) is the
// user's blend: one point of score counts as w positions. A full cache admits a value only when
// its key beats the lowest (Belady with bypass: a value read later than everything cached stays
// out). With no published order every key is the score: the importance policy.
//
// Contract of the keys (the segment layout is unchanged; docs/prefetch.md repeats it):
// - ticks[id] = P + 1 of the next known read of id, 0 for none. Written only by
//   Cache::set_next_use, with the cache mutex held, which rekeys a cached id in the same critical
//   section; the positions come from the order board (shadecache/lookahead/board.py: publish sets every id
//   of the order, each batch boundary the ids just taken).
// - Header::policy_weight is written only by Cache::set_policy_weight, mutex held, which rekeys
//   every cached value. Scores change under the mutex too (update_scores, put with a score) and
//   rekey (keyed_by_score). So under the mutex every heap key equals key(id) of the current
//   ticks, score and weight: check_key tests exactly that, and repair recomputes it.
// - Readers never read or write ticks under this policy (no hit stamps): a hit changes nothing.
//   Positions precision: keys near 2^40 resolve 2^-12, enough for any blend of scores.
#include <cmath>
#include <string>

#include "cache/policies/ticks.h"

namespace shadecache {
namespace {

constexpr double kKnown = 0x1p40;
constexpr double kBlendBound = 0x1p37;
constexpr double kScoreBound = 0x1p36;
static_assert(kKnown - static_cast<double>(kMaxNextUsePosition) - kBlendBound > kScoreBound,
              "every known next use must rank above every unknown one");

double clamp(double v, double bound) { return v < -bound ? -bound : (v > bound ? bound : v); }

struct ClairvoyantPolicy final : EvictionPolicy {
  Policy id() const override { return Policy::kClairvoyant; }
  const char* name() const override { return "clairvoyant"; }
  bool uses_ticks() const override { return true; }
  bool keys_on_next_use() const override { return true; }
  bool keyed_by_score() const override { return true; }
  double insert_key(const PolicyState& s, uint32_t id) const override { return key(s, id); }
  bool admits(double key, double lowest) const override { return key > lowest; }
  double repair_key(const PolicyState& s, uint32_t id) const override { return key(s, id); }
  std::string check_key(const PolicyState& s, uint32_t id, double k) const override {
    double want = key(s, id);
    if (k == want) return "";
    return "has heap key " + std::to_string(k) + " but its next use and score give " + std::to_string(want);
  }
  static double key(const PolicyState& s, uint32_t id) {
    double score = s.scores[id].load(std::memory_order_relaxed);
    uint64_t t = s.ticks[id].load(std::memory_order_relaxed);
    if (t == 0) return clamp(score, kScoreBound);
    return kKnown - static_cast<double>(t - 1) + clamp(*s.weight * score, kBlendBound);
  }
};

const ClairvoyantPolicy kPolicy;
const PolicyRegistration kRegistered(&kPolicy);

}  // namespace
}  // namespace shadecache
