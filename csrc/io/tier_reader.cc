#include "io/tier_reader.h"

#include <cerrno>
#include <cstdio>
#include <cstring>

#include "common/crc32c.h"

namespace shadecache {

std::string TierReader::path_of(const std::string& dir, int64_t id) {
  char tail[48];
  std::snprintf(tail, sizeof tail, "/%02x/%lld.s", static_cast<unsigned>(id % 256),
                static_cast<long long>(id));
  return dir + tail;
}

void TierReader::read(const std::string& dir, const int64_t* ids, size_t n,
                      std::vector<std::string>& paths, std::vector<FileRead>& files,
                      std::vector<Result>& results) {
  paths.resize(n);
  files.clear();
  files.resize(n);
  results.assign(n, Result{kMissing, 0, nullptr, 0});
  for (size_t k = 0; k < n; ++k) {
    paths[k] = path_of(dir, ids[k]);
    files[k].path = paths[k].c_str();
  }
  slot_.with([&](IoBackend& b) { b.read_files(files.data(), n); });
  for (size_t k = 0; k < n; ++k) {
    const FileRead& f = files[k];
    Result& r = results[k];
    if (f.err != 0) {
      bool absent = std::strcmp(f.failed_step, "open") == 0 && (f.err == ENOENT || f.err == ENOTDIR);
      r.status = absent ? kMissing : kFailed;
      r.err = f.err;
      continue;
    }
    r.status = kDamaged;
    if (f.size < kHeaderBytes) continue;
    const char* p = f.data.get();
    uint32_t crc;
    uint64_t len;
    std::memcpy(&crc, p + 4, 4);
    std::memcpy(&len, p + 8, 8);
    if (std::memcmp(p, "SHS1", 4) != 0 || len != f.size - kHeaderBytes) continue;
    if (crc32c(p + kHeaderBytes, len, 0) != crc) continue;
    r = Result{kOk, 0, p + kHeaderBytes, len};
  }
}

}  // namespace shadecache
