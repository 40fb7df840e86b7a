// Reads a packed sample store file (store_format.h). The open validates the header and loads the
// whole sample directory into memory (store_directory.h: 24 bytes per sample, offsets derived from
// the placement); reads are issued in batches through the process's backend (io_backend.h).
//
// Contract: methods that do I/O (read_into, find_corrupt) must be called WITHOUT the GIL and touch
// no Python object; they are safe to call from several threads (the backend serialises them) and
// from forked children (each process gets its own ring or pool). close() must not race with reads.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <vector>

#include "io/extent_read.h"
#include "io/io_backend.h"
#include "io/store_directory.h"
#include "io/store_format.h"

namespace shadecache {

class PackedReader {
 public:
  // Throws kNotFound for a missing file, kFormat for anything malformed (with the reason).
  PackedReader(const std::string& path, BackendKind kind, bool direct, unsigned queue_depth,
               bool verify);
  ~PackedReader();
  PackedReader(const PackedReader&) = delete;
  PackedReader& operator=(const PackedReader&) = delete;

  uint64_t size() const { return dir_->size(); }
  // The directory entry of `id`; throws kOutOfRange naming the id and the store's size.
  const store::Entry& entry(int64_t id) const { return dir_->entry(id); }
  const std::vector<store::Entry>& directory() const { return dir_->entries(); }
  const store::Header& header() const { return dir_->header(); }
  const std::string& meta() const { return dir_->meta(); }
  // The ids in the order their bytes lie in the file (store::placement_order, or 0..n-1).
  std::vector<uint64_t> disk_order() const { return dir_->disk_order(); }
  const std::string& path() const { return path_; }
  bool direct() const { return direct_; }
  bool verify() const { return verify_; }
  BackendSlot& backend() { return slot_; }

  // How batches are coalesced into extents (extent_read.h). Set it before reads start, or
  // between them: not while a read of this store is running.
  void set_shape(const ReadShape& shape) { shape_ = shape; }
  const ReadShape& shape() const { return shape_; }
  ReadCounters& counters() { return counters_; }

  // Reads sample ids[k] into dests[k] (entry(ids[k]).length bytes each; ids already checked),
  // coalesced into extents by shape().
  // With verify, a checksum mismatch throws CorruptSample naming the id and its file offset
  // (the lowest position k in the batch that failed).
  void read_into(const int64_t* ids, size_t n, char* const* dests);
  // Reads samples [first, first + count) and returns the ids whose checksum does not match.
  std::vector<int64_t> find_corrupt(int64_t first, int64_t count);

  void close();  // waits for reads in flight (call without the GIL)
  bool closed() const { return fd_ < 0; }
  // The descriptor reads go through (O_DIRECT when direct()), for a ReadStream to dup.
  int read_fd() const { return direct_ ? direct_fd_ : fd_; }
  int buffered_fd() const { return fd_; }

 private:
  void check_open() const;

  std::string path_;
  int fd_ = -1;         // buffered reads
  int direct_fd_ = -1;  // O_DIRECT reads (when direct_)
  bool direct_, verify_;
  std::unique_ptr<StoreDirectory> dir_;  // validated at open, never changed
  BackendSlot slot_;
  ReadShape shape_;
  ReadCounters counters_;
  std::shared_mutex io_mu_;  // reads hold it shared, close() exclusive
};

}  // namespace shadecache
