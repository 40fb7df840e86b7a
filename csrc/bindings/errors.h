// The one place where engine errors become Python exceptions (classes live in shadecache/errors.py).
#pragma once

#include <pybind11/pybind11.h>

namespace shadecache {
class Error;
// Registers the translator for shadecache::Error; call once from each module's init.
void register_error_translator(pybind11::module_& m);
// Sets the Python error for `e` (for raw CPython entry points that bypass pybind11's dispatch).
void set_python_error(const Error& e);
}  // namespace shadecache
