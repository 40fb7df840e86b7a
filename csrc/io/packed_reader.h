// Reads a packed sample store (store_format.h). The open validates the header and loads the
// whole sample directory into memory (24 bytes per sample, offsets derived from the placement);
// reads are issued in batches through the process's backend (io_backend.h).
//
// Contract: methods that do I/O (read_into, find_corrupt) must be called WITHOUT the GIL and touch
// no Python object; they are safe to call from several threads (the backend serialises them) and
// from forked children (each process gets its own ring or pool). close() must not race with reads.
#pragma once

#include <cstdint>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <vector>

#include "io/extent_read.h"
#include "io/io_backend.h"
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

  uint64_t size() const { return dir_.size(); }
  // The directory entry of `id`; throws kOutOfRange naming the id and the store's size.
  const store::Entry& entry(int64_t id) const;
  const std::vector<store::Entry>& directory() const { return dir_; }
  const store::Header& header() const { return header_; }
  const std::string& meta() const { return meta_; }
  // The ids in the order their bytes lie in the file (store::placement_order, or 0..n-1).
  std::vector<uint64_t> disk_order() const;
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
  void load(int fd);  // validates header, directory and metadata
  // Pass over the directory / metadata region in pieces (into dest when given): *error is the
  // first reason the region is not valid, "" when it is.
  void scan_directory(int fd, store::Entry* dest, std::string* error) const;
  void scan_metadata(int fd, char* dest, std::string* error) const;
  template <typename Each>
  uint32_t scan(int fd, uint64_t off, uint64_t bytes, char* dest, const char* what,
                Each each, uint32_t crc) const;
  void place_samples();  // dir_[id].offset from the lengths in placement order
  [[noreturn]] void format_error(const std::string& why) const;
  void check_open() const;

  std::string path_;
  int fd_ = -1;         // buffered reads
  int direct_fd_ = -1;  // O_DIRECT reads (when direct_)
  bool direct_, verify_;
  store::Header header_{};
  std::vector<store::Entry> dir_;
  std::string meta_;
  BackendSlot slot_;
  ReadShape shape_;
  ReadCounters counters_;
  std::shared_mutex io_mu_;  // reads hold it shared, close() exclusive
};

}  // namespace shadecache
