#include "io/tier_reader.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>

#include "common/crc32c.h"
#include "common/error.h"

namespace shadecache {

namespace {
int64_t mono_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}
}  // namespace

TierReader::~TierReader() {
  for (auto& [id, o] : open_) ::close(o.fd);
  for (int fd : to_close_) ::close(fd);
}

std::string TierReader::path_of(const std::string& dir, int64_t id) {
  char tail[48];
  std::snprintf(tail, sizeof tail, "/%02x/%lld.s", static_cast<unsigned>(id % 256),
                static_cast<long long>(id));
  return dir + tail;
}

void TierReader::lengths_of(const int64_t* ids, size_t n, int64_t* len_out) {
  std::lock_guard<std::mutex> g(mu_);
  for (size_t k = 0; k < n; ++k) {
    auto it = open_.find(ids[k]);
    len_out[k] = it == open_.end() ? -1 : static_cast<int64_t>(it->second.len);
  }
}

void TierReader::forget(int64_t id) {
  std::lock_guard<std::mutex> g(mu_);
  do_drop(id);
}

size_t TierReader::open_files() {
  std::lock_guard<std::mutex> g(mu_);
  return open_.size();
}

void TierReader::do_drop(int64_t id) {
  auto it = open_.find(id);
  if (it == open_.end()) return;
  to_close_.push_back(it->second.fd);
  open_.erase(it);
}

void TierReader::do_sweep() {
  for (auto it = open_.begin(); it != open_.end();) {
    struct stat st;
    if (::fstat(it->second.fd, &st) != 0 || st.st_nlink == 0) {
      to_close_.push_back(it->second.fd);
      it = open_.erase(it);
    } else {
      ++it;
    }
  }
  for (int fd : to_close_) ::close(fd);
  to_close_.clear();
  // order_ may hold ids dropped since; compact it when it grows well past the open set
  if (order_.size() > 2 * open_.size() + 64) {
    std::deque<int64_t> keep;
    for (int64_t id : order_)
      if (open_.count(id)) keep.push_back(id);
    order_.swap(keep);
  }
}

void TierReader::do_remember(int64_t id, const std::string& path, uint32_t len, uint32_t crc) {
  if (max_open_ == 0 || open_.count(id)) return;
  while (open_.size() >= max_open_ && !order_.empty()) {
    int64_t old = order_.front();
    order_.pop_front();
    do_drop(old);
  }
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return;  // removed meanwhile, or out of descriptors: read it by path next time
  // Kept descriptors move above FD_SETSIZE (1024) where the limit allows: thousands of open tier
  // files must not push the process's other descriptors out of select()'s reach.
  int high = ::fcntl(fd, F_DUPFD_CLOEXEC, kHighFd);
  if (high >= 0) {
    ::close(fd);
    fd = high;
  }
  open_[id] = Open{fd, len, crc};
  order_.push_back(id);
}

void TierReader::read(const std::string& dir, const int64_t* ids, size_t n, char* const* dests,
                      std::vector<FileRead>& files, std::vector<Result>& results) {
  std::lock_guard<std::mutex> batch(read_mu_);
  results.assign(n, Result{kMissing, 0, nullptr, 0});
  files.clear();
  files.resize(n);
  // 1. the open files: one value read each, all in one batch
  std::vector<RangeRead> ops;
  std::vector<size_t> op_of;  // position in the batch of each op
  std::vector<uint32_t> want_crc;
  std::vector<size_t> by_path;
  {
    std::lock_guard<std::mutex> g(mu_);
    for (int fd : to_close_) ::close(fd);
    to_close_.clear();
    int64_t now = mono_ns();
    if (now - last_sweep_ns_ > 1000000000) {
      last_sweep_ns_ = now;
      do_sweep();
    }
    for (size_t k = 0; k < n; ++k) {
      auto it = open_.find(ids[k]);
      if (dests && dests[k] && it != open_.end()) {
        RangeRead op{kHeaderBytes, it->second.len, dests[k]};
        op.fd = it->second.fd;
        ops.push_back(op);
        op_of.push_back(k);
        want_crc.push_back(it->second.crc);
      } else {
        by_path.push_back(k);
      }
    }
  }
  if (!ops.empty()) {
    bool failed = false;
    try {
      slot_.with([&](IoBackend& b) { b.read_ranges(-1, false, ops.data(), ops.size(), [](size_t) {}); });
    } catch (const Error&) {  // a file truncated behind our back (or EIO): read these by path
      failed = true;
    }
    std::lock_guard<std::mutex> g(mu_);
    for (size_t j = 0; j < ops.size(); ++j) {
      size_t k = op_of[j];
      if (failed) {
        do_drop(ids[k]);
        by_path.push_back(k);
      } else if (crc32c(ops[j].dest, ops[j].len, 0) != want_crc[j]) {
        do_drop(ids[k]);
        results[k].status = kDamaged;
      } else {
        results[k] = Result{kOk, 0, ops[j].dest, ops[j].len};
      }
    }
    for (int fd : to_close_) ::close(fd);  // no batch is in flight: read_mu_ is ours
    to_close_.clear();
  }
  if (by_path.empty()) return;
  // 2. the others: open, read, close through the backend (io_uring), then checked
  std::vector<std::string> paths(by_path.size());
  std::vector<FileRead> slow(by_path.size());
  for (size_t j = 0; j < by_path.size(); ++j) {
    paths[j] = path_of(dir, ids[by_path[j]]);
    slow[j].path = paths[j].c_str();
  }
  slot_.with([&](IoBackend& b) { b.read_files(slow.data(), slow.size()); });
  std::lock_guard<std::mutex> g(mu_);
  for (size_t j = 0; j < by_path.size(); ++j) {
    size_t k = by_path[j];
    files[k] = std::move(slow[j]);
    const FileRead& f = files[k];
    Result& r = results[k];
    if (f.err != 0) {
      bool absent = std::strcmp(f.failed_step, "open") == 0 && (f.err == ENOENT || f.err == ENOTDIR);
      r = Result{absent ? kMissing : kFailed, f.err, nullptr, 0};
      continue;
    }
    r.status = kDamaged;
    if (f.size < kHeaderBytes) continue;
    const char* p = f.data.get();
    uint32_t crc;
    uint64_t len;
    std::memcpy(&crc, p + 4, 4);
    std::memcpy(&len, p + 8, 8);
    if (std::memcmp(p, "SHS1", 4) != 0 || len != f.size - kHeaderBytes || len > UINT32_MAX) continue;
    if (crc32c(p + kHeaderBytes, len, 0) != crc) continue;
    r = Result{kOk, 0, p + kHeaderBytes, len};
    do_remember(ids[k], paths[j], static_cast<uint32_t>(len), crc);
  }
  for (auto& f : files) f.path = nullptr;  // `paths` dies here
}

}  // namespace shadecache
