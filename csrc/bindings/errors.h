// The one place where engine errors become Python exceptions (classes live in shadecache/errors.py).
#pragma once

#include <pybind11/pybind11.h>

namespace shadecache {
// Registers the translator for shadecache::Error; call once from each module's init.
void register_error_translator(pybind11::module_& m);
}  // namespace shadecache
