#include "io/packed_reader.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <memory>

#include "common/error.h"
#include "io/checked_batch.h"
#include "io/pread_backend.h"

namespace shadecache {
namespace {

// Synchronous read used only at open; false at end of file.
bool pread_exact(int fd, void* buf, size_t n, uint64_t off, const std::string& path) {
  ssize_t r = pread_full(fd, static_cast<char*>(buf), n, off);
  if (r < 0) throw_errno("read " + path, static_cast<int>(-r));
  return static_cast<size_t>(r) == n;
}

// Opens `path` for reading, refusing anything but a regular file. O_NONBLOCK first: a plain open
// of a FIFO waits for a writer that may never come (for a regular file the flag changes nothing,
// and it is cleared anyway). `same_as`, when given, is the file the first descriptor opened: a
// second open (O_DIRECT) must find the same inode, not whatever was renamed there since.
int open_regular(const std::string& path, int flags, const struct stat* same_as) {
  int fd = ::open(path.c_str(), flags | O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) return -1;
  struct stat st;
  int err = 0;
  std::string why;
  if (::fstat(fd, &st) != 0) {
    err = errno;
  } else if (S_ISDIR(st.st_mode)) {
    err = EISDIR;
  } else if (!S_ISREG(st.st_mode)) {
    why = std::string("not a regular file (") +
          (S_ISFIFO(st.st_mode) ? "a FIFO" : S_ISCHR(st.st_mode) ? "a character device"
                                           : S_ISBLK(st.st_mode) ? "a block device"
                                           : S_ISSOCK(st.st_mode) ? "a socket" : "a special file") +
          ")";
  } else if (same_as && (st.st_dev != same_as->st_dev || st.st_ino != same_as->st_ino)) {
    why = "replaced while it was being opened";
  } else {
    int fl = ::fcntl(fd, F_GETFL);
    if (fl < 0 || ::fcntl(fd, F_SETFL, fl & ~O_NONBLOCK) != 0) err = errno;
  }
  if (err == 0 && why.empty()) return fd;
  ::close(fd);
  if (!why.empty()) throw Error(ErrorKind::kFormat, path + ": " + why);
  throw_errno("PackedStore: open " + path, err);
}

}  // namespace

PackedReader::PackedReader(const std::string& path, BackendKind kind, bool direct,
                           unsigned queue_depth, bool verify)
    : path_(path), direct_(direct), verify_(verify), slot_(kind, queue_depth) {
  int fd = open_regular(path, 0, nullptr);
  if (fd < 0) throw_errno("PackedStore: open " + path, errno);
  try {
    struct stat st;
    if (::fstat(fd, &st) != 0) throw_errno("PackedStore: fstat " + path, errno);
    RegionRead read = [&](void* buf, size_t n, uint64_t off) { return pread_exact(fd, buf, n, off, path); };
    dir_ = std::make_unique<StoreDirectory>(path, static_cast<uint64_t>(st.st_size), read);
    if (direct_) {
      direct_fd_ = open_regular(path, O_DIRECT, &st);
      if (direct_fd_ < 0) {
        int err = errno;
        if (err == EINVAL)
          throw Error(ErrorKind::kInvalidArgument,
                      "PackedStore: the file system of " + path +
                          " does not support O_DIRECT (open with direct=False)",
                      err);
        throw_errno("PackedStore: open(O_DIRECT) " + path, err);
      }
    }
  } catch (...) {
    ::close(fd);
    throw;
  }
  // The kernel reads nothing nobody asked for: no read-ahead around these reads, which are
  // random by sample (or whole extents chosen by the reader). A dup (the read stream's) shares it.
  ::posix_fadvise(fd, 0, 0, POSIX_FADV_RANDOM);
  fd_ = fd;
}

PackedReader::~PackedReader() { close(); }

void PackedReader::close() {
  std::unique_lock<std::shared_mutex> lk(io_mu_);
  if (fd_ >= 0) ::close(fd_);
  if (direct_fd_ >= 0) ::close(direct_fd_);
  fd_ = direct_fd_ = -1;
  slot_.close();  // the ring, or this store's share of the pread pool: no thread outlives close()
}

void PackedReader::check_open() const {
  if (fd_ < 0) throw Error(ErrorKind::kClosed, "PackedStore " + path_ + " is closed");
}

void PackedReader::read_into(const int64_t* ids, size_t n, char* const* dests) {
  std::shared_lock<std::shared_mutex> lk(io_mu_);
  check_open();
  CheckedBatch batch(dir_->entries(), ids, n, dests, verify_);
  int fd = direct_ ? direct_fd_ : fd_;
  slot_.with([&](IoBackend& b) { read_samples(b, fd, direct_, batch, shape_, &counters_); });
  batch.throw_if_corrupt(path_);
}

std::vector<int64_t> PackedReader::find_corrupt(int64_t first, int64_t count) {
  std::shared_lock<std::shared_mutex> lk(io_mu_);
  check_open();
  if (count <= 0) return {};
  entry(first);
  entry(first + count - 1);
  std::vector<int64_t> ids(static_cast<size_t>(count));
  size_t total = 0;
  for (int64_t k = 0; k < count; ++k) {
    ids[static_cast<size_t>(k)] = first + k;
    total += dir_->entries()[static_cast<size_t>(first + k)].length;
  }
  std::unique_ptr<char[]> buf(new char[std::max<size_t>(total, 1)]);
  std::vector<char*> dests(ids.size());
  size_t at = 0;
  for (size_t k = 0; k < ids.size(); ++k) {
    dests[k] = buf.get() + at;
    at += dir_->entries()[static_cast<size_t>(ids[k])].length;
  }
  CheckedBatch batch(dir_->entries(), ids.data(), ids.size(), dests.data(), true);
  int fd = direct_ ? direct_fd_ : fd_;
  slot_.with([&](IoBackend& b) { read_samples(b, fd, direct_, batch, shape_, &counters_); });
  return batch.corrupt_ids();
}

}  // namespace shadecache
