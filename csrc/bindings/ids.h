// Sample ids from Python for both extension modules: one rule for what counts as an id array.
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstdint>

namespace shadecache {

using IdArray = pybind11::array_t<int64_t, pybind11::array::c_style | pybind11::array::forcecast>;

// `ids` (an array, or any sequence numpy turns into one) as a contiguous 1-D int64 array.
// Integers only: a cast would truncate floats (1.9 -> id 1) and turn bools and strings into ids,
// so any other dtype is a TypeError (an empty sequence, float64 to numpy, is allowed). A list or
// tuple is taken item by item (as_id), so [2**64] is IndexError as a single id is.
IdArray integer_ids(pybind11::handle ids);

// One sample id from a Python int (or anything with __index__). False with a Python error set:
// TypeError for a non-integer, IndexError for an integer beyond int64 (the range check against
// num_samples is the engine's, and raises IndexError too). The raw METH_O entry points use this.
bool parse_id(PyObject* arg, long long* id);
// The same, throwing pybind11::error_already_set, for pybind11 bindings.
int64_t as_id(pybind11::handle arg);

}  // namespace shadecache
