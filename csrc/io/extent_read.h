// Reads a batch of samples of a packed store as reads of extents: the samples are sorted by
// offset and neighbours whose gap is at most `gap_bytes` are read together, in one read of the
// extent that covers them, so a batch of small samples costs bandwidth instead of one request per
// sample. A read never costs more than reading the gap: gap_bytes is what the device transfers in
// the time one more request costs (bandwidth / IOPS, measured by the store: device_probe.h).
//
// Contract: call without the GIL (nothing here touches Python); the batch's dests[k] receives the
// dir[ids[k]].length bytes of sample ids[k] (ids already range-checked). A sample that is an
// extent alone and needs no widening is read straight into its destination; the others are read
// into a scratch buffer of this thread and copied out. Checksums are verified per sample as its
// extent completes (overlapping the reads still in flight).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "io/checked_batch.h"
#include "io/io_backend.h"
#include "io/store_format.h"

namespace shadecache {

struct ReadShape {
  uint64_t gap_bytes = 0;                 // merge neighbours at most this far apart (0: touching only)
  uint64_t max_extent_bytes = 8u << 20;   // never one read larger than this (unless one sample is)
};

// What a store's reads cost the device, counted as they are issued (extents, not samples).
struct ReadCounters {
  std::atomic<uint64_t> samples{0};   // samples handed out
  std::atomic<uint64_t> requests{0};  // reads issued (extents)
  std::atomic<uint64_t> bytes{0};     // bytes asked of the device (gaps and O_DIRECT widening included)
};

struct Extent {
  uint64_t offset;  // first byte read (a sample's offset)
  uint64_t len;     // bytes read from offset
  size_t first;     // [first, last) index into ExtentPlan::order
  size_t last;
};

struct ExtentPlan {
  std::vector<size_t> order;  // batch positions of the samples with bytes, by offset
  std::vector<Extent> extents;
};

// The extents of a batch (pure: no I/O). With `direct`, gaps are measured between the aligned
// blocks each sample needs, so samples that share a block always merge.
ExtentPlan plan_extents(const store::Entry* dir, const int64_t* ids, size_t n, bool direct,
                        const ReadShape& shape);

// One batch's reads as extents: the ranges to read and what to do as each one lands. read_samples
// reads one through a backend call; the read stream (read_stream.h) feeds several to one call.
class ExtentBatch {
 public:
  // Plans the extents of `batch` (which must outlive this).
  ExtentBatch(CheckedBatch& batch, bool direct, const ReadShape& shape);
  // Bytes of scratch the extents of several samples are read into; place() must be given that
  // many (valid until the last land()) before ops() is read.
  size_t scratch_bytes() const { return scratch_bytes_; }
  void place(char* scratch);
  std::vector<RangeRead>& ops() { return ops_; }
  // Extent x is in: its samples are copied to their destinations (when read into scratch) and
  // checked. Thread-safe for distinct x (the pread pool lands extents from its threads).
  void land(size_t x);
  // Whether every sample of extent x, where its bytes lie now (before land), matches its
  // checksum (true without verify): a fetch that may have brought wrong bytes (an object store's
  // range) is fetched again before anything is landed or recorded as corrupt.
  bool intact(size_t x) const;
  // The largest direct_span of the ranges (0 when not direct).
  uint64_t max_span() const { return max_span_; }
  // Adds the batch to `counters` (samples handed out, requests, bytes asked): called once, after
  // every extent has landed.
  void count(ReadCounters* counters) const;

 private:
  CheckedBatch& batch_;
  ExtentPlan plan_;
  std::vector<RangeRead> ops_;
  std::vector<size_t> scratch_at_;  // offset in scratch, SIZE_MAX: straight to its destination
  size_t scratch_bytes_ = 0;
  uint64_t max_span_ = 0;
  uint64_t asked_ = 0;  // bytes asked of the device (gaps and O_DIRECT widening included)
};

// Reads the batch through `backend`, each sample checked (batch.check) as its extent completes;
// the caller asks the batch what failed. Throws what the backend throws (after the batch drained).
void read_samples(IoBackend& backend, int fd, bool direct, CheckedBatch& batch, const ReadShape& shape,
                  ReadCounters* counters);

}  // namespace shadecache
