// The peer layer's native batch I/O (bindings/peer_io.cc), registered into shadecache._core.
#pragma once

#include <pybind11/pybind11.h>

#include <cstddef>

namespace shadecache {
void register_peer_io(pybind11::module_& m);

// A GET reply message carries at most this many bytes of values (one larger value aside): the
// server seals a message whole, then hands it to the kernel (bindings/peer_io.cc), and the
// benchmark's bare frame stream does the same (bindings/peer_costs.cc).
constexpr size_t kReplyMessageBytes = 512 << 10;
}
