#include "io/folder_reader.h"

#include <cstring>

#include "common/error.h"

namespace shadecache {

FolderReader::FolderReader(std::vector<std::string> paths, BackendKind kind, unsigned queue_depth)
    : paths_(std::move(paths)), slot_(kind, queue_depth) {}

const std::string& FolderReader::path(int64_t id) const {
  if (id < 0 || static_cast<uint64_t>(id) >= paths_.size())
    throw Error(ErrorKind::kOutOfRange, "sample id " + std::to_string(id) + " out of range [0, " +
                                            std::to_string(paths_.size()) + ") of the folder");
  return paths_[static_cast<size_t>(id)];
}

void FolderReader::read(const int64_t* ids, size_t n, std::vector<FileRead>& out) {
  out.clear();
  out.resize(n);
  for (size_t k = 0; k < n; ++k) out[k].path = paths_[static_cast<size_t>(ids[k])].c_str();
  slot_.with([&](IoBackend& b) { b.read_files(out.data(), n); });
  for (size_t k = 0; k < n; ++k) {
    const FileRead& f = out[k];
    if (f.err != 0)
      throw_errno("FolderStore: sample " + std::to_string(ids[k]) + ": " + f.failed_step + " " +
                      f.path,
                  f.err);
  }
}

}  // namespace shadecache
