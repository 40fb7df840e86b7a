// importance (SHADE): the key is the sample's score. A full cache admits a value only when its
// score beats the lowest cached one, and evicts that one.
#include <string>

#include "cache/policy.h"

namespace shadecache {
namespace {

struct ImportancePolicy final : EvictionPolicy {
  Policy id() const override { return Policy::kImportance; }
  const char* name() const override { return "importance"; }
  bool keyed_by_score() const override { return true; }
  double insert_key(const PolicyState& s, uint32_t id) const override { return score(s, id); }
  bool admits(double key, double lowest) const override { return key > lowest; }
  double repair_key(const PolicyState& s, uint32_t id) const override { return score(s, id); }
  std::string check_key(const PolicyState& s, uint32_t id, double key) const override {
    if (key == score(s, id)) return "";
    return "has heap key " + std::to_string(key) + " but score " + std::to_string(score(s, id));
  }
  static double score(const PolicyState& s, uint32_t id) { return s.scores[id].load(std::memory_order_relaxed); }
};

const ImportancePolicy kPolicy;
const PolicyRegistration kRegistered(&kPolicy);

}  // namespace
}  // namespace shadecache
