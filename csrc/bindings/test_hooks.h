// Test-only entry points of _core (fault injection for the crash and race tests, a GIL-free busy
// wait for the benchmarks). Kept apart from the module definition so that no user-facing binding
// sits next to them.
#pragma once

#include <pybind11/pybind11.h>

namespace shadecache {

void register_test_hooks(pybind11::module_& m);

}  // namespace shadecache
