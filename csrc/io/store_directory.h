// The validated, in-memory sample directory of a packed store (store_format.h): the header, every
// sample's entry (offset derived from the placement, length, crc32c, label) and the metadata.
// Where the bytes come from is the caller's: a file read with pread (PackedReader), or the
// header block and the tail [dir_offset, file_bytes) of an object fetched with ranged GETs (the
// object store, shadecache/store/s3.py), so both readers refuse a malformed store with the same
// checks and the same messages.
//
// Contract: a constructed StoreDirectory is valid (every check of docs/store_format.md, "Validation
// at open", passed) and immutable, so any number of threads may read it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "io/store_format.h"

namespace shadecache {

// Reads n bytes at store offset `off` into buf: true when all n are there, false when the store
// ends (or, for an image, holds no bytes) before; throws for an I/O error.
using RegionRead = std::function<bool(void* buf, size_t n, uint64_t off)>;

class StoreDirectory {
 public:
  // Validates the store named `name` (a path or a URL, for messages) of `size` bytes, read
  // through `read`, and loads its directory. Throws kFormat naming `name` and the reason,
  // kCapacity when the directory cannot be held in memory.
  StoreDirectory(std::string name, uint64_t size, const RegionRead& read);

  // Checks a header alone (its first 128 bytes in `bytes`) against a store of `size` bytes: the
  // checks that need no directory (magic, version, header checksum, geometry, offsets, size).
  // What the object store asks before it fetches [dir_offset, file_bytes).
  static store::Header check_header(const std::string& name, const void* bytes, size_t n,
                                    uint64_t size);

  const std::string& name() const { return name_; }
  const store::Header& header() const { return header_; }
  uint64_t size() const { return dir_.size(); }
  const std::vector<store::Entry>& entries() const { return dir_; }
  const std::string& meta() const { return meta_; }
  // The entry of `id`; throws kOutOfRange naming the id and the store's size.
  const store::Entry& entry(int64_t id) const;
  // The ids in the order their bytes lie in the store (store::placement_order, or 0..n-1).
  std::vector<uint64_t> disk_order() const;

 private:
  [[noreturn]] void format_error(const std::string& why) const;
  void scan_directory(store::Entry* dest, std::string* error) const;
  void scan_metadata(char* dest, std::string* error) const;
  template <typename Each>
  uint32_t scan(uint64_t off, uint64_t bytes, char* dest, const char* what, Each each,
                uint32_t crc) const;
  void place_samples();

  std::string name_;
  const RegionRead* read_ = nullptr;  // only while the constructor runs
  store::Header header_{};
  std::vector<store::Entry> dir_;
  std::string meta_;
};

}  // namespace shadecache
