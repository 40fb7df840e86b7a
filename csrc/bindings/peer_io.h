// The peer layer's native batch I/O (bindings/peer_io.cc), registered into shadecache._core.
#pragma once

#include <pybind11/pybind11.h>

namespace shadecache {
void register_peer_io(pybind11::module_& m);
}
