// static: values stay until removed; a full cache refuses new ones (every key is 0).
#include <string>

#include "cache/policy.h"

namespace shadecache {
namespace {

struct StaticPolicy final : EvictionPolicy {
  Policy id() const override { return Policy::kStatic; }
  const char* name() const override { return "static"; }
  bool evicts() const override { return false; }
  double insert_key(const PolicyState&, uint32_t) const override { return 0.0; }
  double repair_key(const PolicyState&, uint32_t) const override { return 0.0; }
  std::string check_key(const PolicyState&, uint32_t, double key) const override {
    return key == 0.0 ? "" : "has a non-zero heap key under the static policy";
  }
};

const StaticPolicy kPolicy;
const PolicyRegistration kRegistered(&kPolicy);

}  // namespace
}  // namespace shadecache
