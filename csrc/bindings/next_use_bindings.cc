// Bindings of the clairvoyant policy's inputs on CacheCore: set_next_use, policy_weight.
// Arguments are copied into native arrays with the GIL held, then the engine runs without it
// (it waits for the cache mutex).
#include "bindings/next_use_bindings.h"

#include <pybind11/numpy.h>

#include <string>
#include <vector>

#include "bindings/ids.h"
#include "cache/cache.h"

namespace py = pybind11;

namespace shadecache {
namespace {

// A copy of a 1-D integer array, by the rule of ids (floats and bools refused, not truncated).
std::vector<int64_t> int64_vector(py::handle h, const char* what) {
  IdArray a;
  try {
    a = integer_ids(h);
  } catch (py::type_error&) {
    throw py::type_error(std::string(what) + " must be a sequence or array of integers");
  } catch (py::error_already_set& e) {  // a list's items go through as_id, which sets the error
    if (!e.matches(PyExc_TypeError)) throw;
    throw py::type_error(std::string(what) + " must be a sequence or array of integers");
  }
  return std::vector<int64_t>(a.data(), a.data() + a.size());
}

}  // namespace

void register_next_use(py::module_& m) {
  auto cls = py::reinterpret_borrow<py::class_<Cache>>(m.attr("CacheCore"));
  cls.def(
      "set_next_use",
      [](Cache& c, py::handle ids, py::handle positions) {
        std::vector<int64_t> v = int64_vector(ids, "ids");
        std::vector<int64_t> p = int64_vector(positions, "positions");
        if (v.size() != p.size())
            throw py::value_error("set_next_use got " + std::to_string(v.size()) + " ids but " +
                                  std::to_string(p.size()) + " positions");
        py::gil_scoped_release nogil;
        c.set_next_use(v.data(), p.data(), v.size());
      },
      py::arg("ids"), py::arg("positions"),
      "Next read position of each id (-1: none known), the clairvoyant policy's input; one lock.");
  cls.def_property(
      "policy_weight",
      [](Cache& c) {
        py::gil_scoped_release nogil;
        return c.policy_weight();
      },
      [](Cache& c, double w) {
        py::gil_scoped_release nogil;
        c.set_policy_weight(w);
      });
  cls.def_property_readonly("keys_on_next_use", [](Cache& c) {
    c.check_open();
    return c.keys_on_next_use();
  });
}

}  // namespace shadecache
