#include "cache/policy.h"

namespace shadecache {
namespace {

// Function-local: the policies register from static initializers of other files.
std::vector<const EvictionPolicy*>& registry() {
  static std::vector<const EvictionPolicy*> r;
  return r;
}

}  // namespace

PolicyRegistration::PolicyRegistration(const EvictionPolicy* p) {
  auto& r = registry();
  uint32_t i = static_cast<uint32_t>(p->id());
  if (r.size() <= i) r.resize(i + 1, nullptr);
  r[i] = p;
}

const EvictionPolicy* policy_by_id(uint32_t id) {
  const auto& r = registry();
  return id < r.size() ? r[id] : nullptr;
}

std::vector<std::string> policy_names() {
  std::vector<std::string> out;
  for (const EvictionPolicy* p : registry()) out.push_back(p ? p->name() : "");
  return out;
}

}  // namespace shadecache
