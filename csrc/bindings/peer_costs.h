// Measures of what a sealed peer GET costs at the least (bindings/peer_costs.cc), registered into
// shadecache._core for bench/cluster.py.
#pragma once

#include <pybind11/pybind11.h>

namespace shadecache {
void register_peer_costs(pybind11::module_& m);
}
