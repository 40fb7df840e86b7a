// Writes a packed sample store (format in store_format.h) atomically.
//
// Contract: samples go to "<path>.tmp.<pid>.<n>" in the destination's directory; close() writes the
// directory, the metadata and finally the header, fsyncs, renames onto <path> and fsyncs the
// directory. Until close() returns, <path> is untouched (an older store there stays valid) and the
// temporary file has an all-zero header, so it never opens as a store. abort() (or destroying an
// unclosed writer) removes the temporary file. Not thread-safe; one writer per file.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "io/store_format.h"

namespace shadecache {

class PackWriter {
 public:
  explicit PackWriter(const std::string& path);
  ~PackWriter();
  PackWriter(const PackWriter&) = delete;
  PackWriter& operator=(const PackWriter&) = delete;

  // Appends one sample; returns its id (0, 1, 2, ... in call order).
  uint64_t add(const void* data, size_t n, int64_t label);
  // Finishes the store with `meta` (UTF-8 JSON, may be empty) and renames it into place.
  void close(const std::string& meta);
  // Drops everything written so far; a no-op after close() or abort().
  void abort();

  uint64_t num_samples() const { return entries_.size(); }
  bool is_open() const { return fd_ >= 0; }
  const std::string& path() const { return path_; }
  const std::string& temp_path() const { return tmp_path_; }

 private:
  void write_all(const void* data, size_t n);  // buffered append at pos_
  void flush();
  void check_open() const;

  std::string path_, tmp_path_;
  int fd_ = -1;
  uint64_t pos_ = 0;          // logical end of file (buffered bytes included)
  std::vector<char> buf_;     // write buffer: few large write() calls instead of one per sample
  size_t buf_used_ = 0;
  std::vector<store::Entry> entries_;
};

}  // namespace shadecache
