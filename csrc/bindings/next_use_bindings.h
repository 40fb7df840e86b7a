// The clairvoyant policy's bindings on CacheCore (defined apart from core_module.cc).
#pragma once

#include <pybind11/pybind11.h>

namespace shadecache {

// Adds set_next_use, policy_weight and keys_on_next_use to m.CacheCore (already defined).
void register_next_use(pybind11::module_& m);

}  // namespace shadecache
