// Measures what one more read request costs on the device under a store file, in the bytes it
// could have transferred instead: the gap threshold of extent_read.h (bandwidth / IOPS).
//
// Timed batches over random aligned places of [lo, hi): batches of `small` reads of 4 KiB at the
// backend's queue depth (requests per second), then of `large` reads of 1 MiB (bytes per second),
// each kind for 0.4 s (at least two batches), its rate the median of the batches after the first
// third (a throttled or cloud disk serves a first burst faster than it sustains, and then makes
// the next reads pay for it), or the last batch's when no batch started after it.
// Read with O_DIRECT where the file system allows it, so the page cache answers nothing; else
// buffered, after POSIX_FADV_DONTNEED of the places read (a file system without a device, such
// as tmpfs, then measures memory). Call without the GIL.
#pragma once

#include <cstdint>
#include <string>

#include "io/io_backend.h"

namespace shadecache {

struct DeviceProbe {
  double iops = 0;       // 4 KiB reads per second at the queue depth
  double bandwidth = 0;  // bytes per second of 1 MiB reads
  bool direct = false;   // measured with O_DIRECT
};

DeviceProbe probe_device(const std::string& path, int buffered_fd, uint64_t lo, uint64_t hi,
                         IoBackend& backend, unsigned small, unsigned large, uint64_t seed);

}  // namespace shadecache
