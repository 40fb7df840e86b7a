#include "io/device_probe.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "common/error.h"
#include "io/store_format.h"

namespace shadecache {
namespace {

// seconds of each kind of read: several of the cgroup throttle's 100 ms slices, whose budget a
// short probe sees as a burst (shorter phases measured far more than the throttle allows:
// docs/store_format.md, "Reads shaped for the device: extents")
constexpr double kPhaseS = 0.4;
constexpr unsigned kMaxBatches = 64;  // a fast device is measured in fewer seconds

double timed_reads(IoBackend& backend, int fd, bool direct, std::vector<RangeRead>& ops) {
  if (!direct)
    for (const RangeRead& op : ops) ::posix_fadvise(fd, op.offset, op.len, POSIX_FADV_DONTNEED);
  auto t0 = std::chrono::steady_clock::now();
  backend.read_ranges(fd, direct, ops.data(), ops.size(), [](size_t) {});
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

DeviceProbe probe_device(const std::string& path, int buffered_fd, uint64_t lo, uint64_t hi,
                         IoBackend& backend, unsigned small, unsigned large, uint64_t seed) {
  DeviceProbe out;
  if (small == 0 || large == 0)
    throw Error(ErrorKind::kInvalidArgument, "probe_device: small and large must be >= 1 (reads "
                                             "per batch), not " + std::to_string(small) + " and " +
                                             std::to_string(large));
  constexpr uint32_t kSmall = 4096, kLarge = 1u << 20;
  lo = store::align_down(lo);
  uint64_t span = hi > lo ? hi - lo : 0;
  uint32_t large_bytes = static_cast<uint32_t>(std::min<uint64_t>(kLarge, std::max<uint64_t>(span, kSmall)));
  // Allocated before the descriptor is opened: nothing to close when it cannot be.
  std::unique_ptr<char[]> buf(new char[std::max<size_t>(size_t{small} * kSmall, size_t{large} * large_bytes) + large_bytes]);
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_DIRECT);
  struct stat a, b;
  if (fd >= 0 && (::fstat(fd, &a) != 0 || ::fstat(buffered_fd, &b) != 0 || a.st_dev != b.st_dev ||
                  a.st_ino != b.st_ino)) {
    ::close(fd);  // not the file the store opened (renamed over since): measure buffered
    fd = -1;
  }
  out.direct = fd >= 0;
  int use = out.direct ? fd : buffered_fd;
  uint64_t state = seed;
  auto place = [&](uint64_t bytes) {  // a random aligned offset with `bytes` inside [lo, hi)
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    uint64_t room = span > bytes ? (span - bytes) / store::kAlign : 0;
    return lo + (room ? (state >> 11) % (room + 1) : 0) * store::kAlign;
  };
  try {
    // One untimed read of each size first: the backend sizes (and registers) its O_DIRECT
    // buffers for the largest read, which must not be part of what is timed. Then batches of
    // each kind for kPhaseS seconds each, the rate taken over the batches after the first third
    // of the phase: a throttled or cloud disk serves a first burst at full speed (the cgroup
    // blkio throttle grants a slice's budget at once), and what is wanted is the steady rate.
    std::vector<RangeRead> ops{RangeRead{place(large_bytes), large_bytes, buf.get()},
                               RangeRead{place(kSmall), kSmall, buf.get() + large_bytes}};
    timed_reads(backend, use, out.direct, ops);
    // At least two batches; the rate is that of all the batches that started after the phase's
    // first third taken together (their reads over their time; the last batch's when none
    // started then). Not a median of per-batch rates: under the cgroup throttle a slice's budget
    // lets several batches through at the device's full speed and then holds one for the rest
    // of the slice, so most batches look fast and the median was the burst's rate, tens of times
    // the throttle's (docs/store_format.md, "Reads shaped for the device: extents").
    auto phase = [&](unsigned count, uint32_t bytes) {
      double elapsed = 0, last = 0, steady_s = 0, steady_reads = 0;
      for (unsigned b = 0; b < kMaxBatches && (elapsed < kPhaseS || b < 2); ++b) {
        ops.clear();
        for (unsigned i = 0; i < count; ++i)
          ops.push_back(RangeRead{place(bytes), bytes, buf.get() + size_t{i} * bytes});
        double t = timed_reads(backend, use, out.direct, ops);
        last = count / std::max(t, 1e-9);
        if (elapsed >= kPhaseS / 3) {
          steady_s += t;
          steady_reads += count;
        }
        elapsed += t;
      }
      return steady_s > 0 ? steady_reads / steady_s : last;
    };
    out.iops = phase(small, kSmall);
    out.bandwidth = phase(large, large_bytes) * large_bytes;
  } catch (...) {
    if (fd >= 0) ::close(fd);
    throw;
  }
  if (fd >= 0) ::close(fd);
  return out;
}

}  // namespace shadecache
