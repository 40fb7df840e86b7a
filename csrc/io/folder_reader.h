// Reads samples stored one file per sample (an image-folder tree), with the same batching as
// PackedReader: the backend opens, sizes, reads and closes up to queue_depth files at a time.
// The list of paths (id -> path) is built by the caller (shadecache/store/folder.py scans the tree).
//
// Contract: read() must be called WITHOUT the GIL; it throws for the first file (in batch order)
// that could not be read, naming its id, path and the failing step.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "io/io_backend.h"

namespace shadecache {

class FolderReader {
 public:
  FolderReader(std::vector<std::string> paths, BackendKind kind, unsigned queue_depth);

  uint64_t size() const { return paths_.size(); }
  const std::string& path(int64_t id) const;  // throws kOutOfRange
  BackendSlot& backend() { return slot_; }

  // Reads the files of ids (already range-checked) into out[k].data / out[k].size.
  void read(const int64_t* ids, size_t n, std::vector<FileRead>& out);
  void close() { slot_.close(); }  // later reads: kClosed (BackendSlot::with)

 private:
  std::vector<std::string> paths_;
  BackendSlot slot_;
};

}  // namespace shadecache
