// Writes a packed sample store (format in store_format.h) atomically.
//
// Contract: samples go to "<path>.tmp.<pid>.<n>" in the destination's directory; close() writes the
// directory, the metadata and finally the header, fsyncs, renames onto <path> and fsyncs the
// directory. Until close() returns, <path> is untouched (an older store there stays valid) and the
// temporary file has an all-zero header, so it never opens as a store. abort() (or destroying an
// unclosed writer) removes the temporary file. Not thread-safe; one writer per file.
//
// Placement: with `shuffle`, samples are added in id order but laid out in the order
// store::placement_order(n, seed) gives (n is known only at close): add() appends them to an
// anonymous staging file (O_TMPFILE in the destination's directory: nothing is left behind by a
// killed pack), and close() copies them into the store in placement order. That costs the data's
// size once more in temporary space and one more write of it; without `shuffle` the samples go
// straight to the store in id order.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "io/store_format.h"

namespace shadecache {

class PackWriter {
 public:
  PackWriter(const std::string& path, bool shuffle = false, uint64_t seed = 0);
  ~PackWriter();
  PackWriter(const PackWriter&) = delete;
  PackWriter& operator=(const PackWriter&) = delete;

  // Appends one sample; returns its id (0, 1, 2, ... in call order).
  uint64_t add(const void* data, size_t n, int64_t label);
  // Finishes the store with `meta` (UTF-8 JSON, may be empty) and renames it into place.
  void close(const std::string& meta);
  // Drops everything written so far; a no-op after close() or abort().
  void abort();

  uint64_t num_samples() const { return lengths_.size(); }
  bool is_open() const { return fd_ >= 0; }
  bool shuffle() const { return shuffle_; }
  uint64_t seed() const { return seed_; }
  const std::string& path() const { return path_; }
  const std::string& temp_path() const { return tmp_path_; }

 private:
  void write_all(const void* data, size_t n);  // buffered append at pos_ of out_fd_
  void flush();
  void check_open() const;
  void copy_in_placement_order();  // staging -> store, slot by slot

  std::string path_, tmp_path_;
  int fd_ = -1;        // the store's temporary file
  int stage_fd_ = -1;  // with shuffle: the anonymous staging file samples are appended to
  int out_fd_ = -1;    // where write_all appends: stage_fd_ while adding with shuffle, else fd_
  bool shuffle_;
  uint64_t seed_;
  uint64_t pos_ = 0;          // logical end of out_fd_ (buffered bytes included)
  std::vector<char> buf_;     // write buffer: few large write() calls instead of one per sample
  size_t buf_used_ = 0;
  std::vector<uint32_t> lengths_, crcs_;  // by id
  std::vector<int64_t> labels_;
};

}  // namespace shadecache
