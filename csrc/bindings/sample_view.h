// SampleView: the Python face of a pinned zero-copy view (Cache::pin). A plain CPython type,
// because it must export the buffer protocol and count its exports (release() refuses while a
// memoryview or numpy array still points into the slot), which pybind11's def_buffer cannot.
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>

namespace shadecache {
class Cache;
// Readies the type and adds it to module `m` as SampleView.
void register_sample_view(pybind11::module_& m);
// A new SampleView of sample `id` of `cache`, or None on a miss. `owner` (the CacheCore object)
// is kept alive by the view. Raises what Cache::pin raises.
pybind11::object make_sample_view(pybind11::handle owner, Cache& cache, uint64_t id);
}  // namespace shadecache
