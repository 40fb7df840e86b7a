#include "bindings/test_hooks.h"

#include <algorithm>
#include <chrono>

#include "cache/crash_point.h"

namespace py = pybind11;

namespace shadecache {

void register_test_hooks(py::module_& m) {
  // SIGKILL this process at crash point `point` after `countdown` passes (0 disarms).
  m.def("_arm_crash_point", [](int point, long countdown) {
    g_crash_countdown.store(countdown);
    g_crash_point.store(countdown > 0 ? point : 0);
  });
  // Make every Cache.create of this process sleep `ms` between sizing and reserving the segment.
  m.def("_set_create_delay_ms", [](long ms) { g_create_delay_ms.store(ms); });
  // Keep this thread's core busy for `ns` nanoseconds without the GIL: a benchmark's stand-in for
  // a training step whose thread waits on the GPU the way CUDA waits by default (spinning), so
  // that the core neither idles (and loses its caches) nor holds the GIL the loader's threads need.
  // `ns` is clamped to [0, 1 h] (a larger one would overflow the deadline); not interruptible.
  m.def("_busy_wait_ns", [](long long ns) {
    ns = std::min<long long>(std::max<long long>(ns, 0), 3600LL * 1000 * 1000 * 1000);
    py::gil_scoped_release nogil;
    auto end = std::chrono::steady_clock::now() + std::chrono::nanoseconds(ns);
    while (std::chrono::steady_clock::now() < end) {
    }
  });
  py::dict points;
  for (const auto& [name, point] : crash_point_names()) points[name] = static_cast<int>(point);
  m.attr("CRASH_POINTS") = points;
}

}  // namespace shadecache
