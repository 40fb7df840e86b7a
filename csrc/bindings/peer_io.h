// The peer layer's native batch I/O (bindings/peer_io.cc), registered into shadecache._core.
#pragma once

#include <pybind11/pybind11.h>

#include <cstddef>

namespace shadecache {
void register_peer_io(pybind11::module_& m);

// A GET reply message carries at most this many values and bytes of values (one larger value
// aside), so that the first message of a reply leaves early and the client opens it while the
// next is sealed (bindings/peer_io.cc); the benchmark's bare frame stream cuts its records the
// same way (bindings/peer_costs.cc).
constexpr size_t kReplyMessageItems = 256;
constexpr size_t kReplyMessageBytes = 512 << 10;
}
