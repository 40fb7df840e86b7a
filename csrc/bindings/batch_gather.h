// Batch assembly for CachedLoader: the values of a batch of ids copied out of the cache by one
// call, with the GIL released, into one buffer: a (B, S) buffer of fixed-size rows, or one flat
// buffer plus per-id lengths. No Python object per sample.
#pragma once

#include <pybind11/pybind11.h>

namespace shadecache {
// Adds gather_rows and gather_flat to module `m` (shadecache._core).
void register_batch_gather(pybind11::module_& m);
}  // namespace shadecache
