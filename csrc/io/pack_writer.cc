#include "io/pack_writer.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <memory>

#include "common/crc32c.h"
#include "common/error.h"
#include "io/pread_backend.h"

namespace shadecache {
namespace {

constexpr size_t kBufBytes = 4 << 20;

std::string dir_of(const std::string& path) {
  auto slash = path.rfind('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

void pwrite_all(int fd, const void* data, size_t n, uint64_t off, const std::string& what) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    ssize_t r = ::pwrite(fd, p, n, static_cast<off_t>(off));
    if (r < 0) {
      if (errno == EINTR) continue;
      throw_errno(what, errno);
    }
    p += r;
    n -= static_cast<size_t>(r);
    off += static_cast<uint64_t>(r);
  }
}

// The narrowest width (1, 2 or 4 bytes) that holds every length.
uint32_t length_width(const std::vector<uint32_t>& v) {
  uint32_t top = v.empty() ? 0 : *std::max_element(v.begin(), v.end());
  return top <= 0xFFu ? 1 : top <= 0xFFFFu ? 2 : 4;
}

// The narrowest signed width (1, 2, 4 or 8 bytes) that holds every label.
uint32_t label_width(const std::vector<int64_t>& v) {
  if (v.empty()) return 1;
  auto [lo, hi] = std::minmax_element(v.begin(), v.end());
  for (uint32_t w : {1u, 2u, 4u}) {
    int64_t top = (int64_t{1} << (8 * w - 1)) - 1;
    if (*lo >= -top - 1 && *hi <= top) return w;
  }
  return 8;
}

// Appends the low `width` bytes of every value (little-endian: the first bytes of each).
template <typename T>
void append_column(std::vector<char>& out, const std::vector<T>& v, uint32_t width) {
  size_t at = out.size();
  out.resize(at + v.size() * width);
  for (size_t i = 0; i < v.size(); ++i) std::memcpy(&out[at + i * width], &v[i], width);
}

// An anonymous file in `dir` (gone when closed, also after a crash); a named one unlinked at once
// where the file system has no O_TMPFILE.
int open_staging(const std::string& dir, const std::string& fallback_name) {
  int fd = ::open(dir.c_str(), O_TMPFILE | O_RDWR | O_CLOEXEC, 0600);
  if (fd >= 0) return fd;
  fd = ::open(fallback_name.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) throw_errno("PackWriter: create a staging file in " + dir, errno);
  ::unlink(fallback_name.c_str());
  return fd;
}

}  // namespace

PackWriter::PackWriter(const std::string& path, bool shuffle, uint64_t seed)
    : path_(path), shuffle_(shuffle), seed_(shuffle ? seed : 0) {
  if (path.empty()) throw Error(ErrorKind::kInvalidArgument, "PackWriter: empty path");
  static std::atomic<unsigned> counter{0};
  // Same directory as the destination, so the final rename() is atomic (same file system).
  tmp_path_ = path + ".tmp." + std::to_string(::getpid()) + "." + std::to_string(counter++);
  fd_ = ::open(tmp_path_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd_ < 0) throw_errno("PackWriter: create " + tmp_path_, errno);
  // A constructor that throws has no destructor: whatever fails here (the staging file, the
  // header block's write with shuffle) removes the temporary file and closes both descriptors.
  try {
    if (shuffle_) stage_fd_ = open_staging(dir_of(path_), tmp_path_ + ".stage");
    buf_.resize(kBufBytes);
    // The header block stays zero until close(): a killed pack leaves a file with bad magic.
    out_fd_ = fd_;
    pos_ = 0;
    write_all(std::vector<char>(store::kHeaderBytes, 0).data(), store::kHeaderBytes);
    if (shuffle_) {
      flush();
      out_fd_ = stage_fd_;
      pos_ = 0;
    }
  } catch (...) {
    abort();
    throw;
  }
}

PackWriter::~PackWriter() { abort(); }

void PackWriter::check_open() const {
  if (fd_ < 0) throw Error(ErrorKind::kClosed, "PackWriter " + path_ + " is closed");
}

void PackWriter::flush() {
  pwrite_all(out_fd_, buf_.data(), buf_used_, pos_ - buf_used_, "PackWriter: write " + tmp_path_);
  buf_used_ = 0;
}

void PackWriter::write_all(const void* data, size_t n) {
  if (buf_used_ + n > buf_.size()) {
    flush();
    if (n > buf_.size()) {  // large sample: straight to the file, no copy through the buffer
      pwrite_all(out_fd_, data, n, pos_, "PackWriter: write " + tmp_path_);
      pos_ += n;
      return;
    }
  }
  std::memcpy(buf_.data() + buf_used_, data, n);
  buf_used_ += n;
  pos_ += n;
}

uint64_t PackWriter::add(const void* data, size_t n, int64_t label) {
  check_open();
  if (n > store::kMaxSampleBytes)
    throw Error(ErrorKind::kTooLarge, "PackWriter: sample " + std::to_string(lengths_.size()) +
                                          " has " + std::to_string(n) +
                                          " bytes; the format holds at most 4 GiB - 1 per sample");
  uint32_t crc = crc32c(data, n);
  write_all(data, n);
  lengths_.push_back(static_cast<uint32_t>(n));
  crcs_.push_back(crc);
  labels_.push_back(label);
  return lengths_.size() - 1;
}

void PackWriter::copy_in_placement_order() {
  flush();
  uint64_t n = lengths_.size();
  std::vector<uint64_t> at(n);  // each sample's offset in the staging file (id order)
  uint64_t off = 0;
  for (uint64_t i = 0; i < n; ++i) {
    at[i] = off;
    off += lengths_[i];
  }
  out_fd_ = fd_;
  pos_ = store::kHeaderBytes;
  std::vector<char> one;
  for (uint64_t id : store::placement_order(n, seed_)) {
    uint32_t len = lengths_[id];
    if (len == 0) continue;
    char* dest;
    if (buf_used_ + len <= buf_.size()) {
      dest = buf_.data() + buf_used_;  // read straight into the write buffer
    } else {
      flush();
      if (len > buf_.size()) one.resize(len);
      dest = len > buf_.size() ? one.data() : buf_.data();
    }
    ssize_t r = pread_full(stage_fd_, dest, len, at[id]);
    if (r < 0) throw_errno("PackWriter: read back the staging file of " + path_, static_cast<int>(-r));
    if (static_cast<size_t>(r) != len)
      throw Error(ErrorKind::kOs, "PackWriter: the staging file of " + path_ + " was cut short", EIO);
    if (dest == one.data()) {
      pwrite_all(fd_, dest, len, pos_, "PackWriter: write " + tmp_path_);
    } else {
      buf_used_ += len;
    }
    pos_ += len;
  }
  ::close(stage_fd_);
  stage_fd_ = -1;
}

void PackWriter::close(const std::string& meta) {
  check_open();
  if (shuffle_) copy_in_placement_order();
  uint64_t n = lengths_.size();
  store::Header h;
  std::memset(&h, 0, sizeof(h));
  std::memcpy(h.magic, store::kMagic, sizeof(h.magic));
  h.version = store::kVersion;
  h.header_bytes = store::kHeaderBytes;
  h.len_width = length_width(lengths_);
  h.label_width = label_width(labels_);
  h.num_samples = n;
  h.data_offset = store::kHeaderBytes;
  h.dir_offset = pos_;
  h.data_bytes = h.dir_offset - h.data_offset;
  std::vector<char> dir;
  dir.reserve(n * store::entry_bytes(h) + store::kTrailerBytes);
  append_column(dir, lengths_, h.len_width);
  append_column(dir, crcs_, store::kCrcBytes);
  append_column(dir, labels_, h.label_width);
  dir.insert(dir.end(), store::kDirMagic, store::kDirMagic + sizeof(store::kDirMagic));
  dir.resize(dir.size() + sizeof(uint64_t));
  std::memcpy(dir.data() + dir.size() - sizeof(uint64_t), &n, sizeof(uint64_t));
  h.dir_bytes = dir.size();
  h.dir_crc = crc32c(dir.data(), dir.size());
  write_all(dir.data(), dir.size());
  h.meta_offset = pos_;
  h.meta_bytes = meta.size();
  h.meta_crc = crc32c(meta.data(), meta.size());
  write_all(meta.data(), meta.size());
  h.file_bytes = pos_;
  h.placement = shuffle_ ? store::kShuffled : store::kAsWritten;
  h.placement_seed = seed_;
  h.header_crc = crc32c(&h, offsetof(store::Header, header_crc));
  flush();
  // Data and directory must be durable before the header that makes them valid, and the header
  // before the rename that publishes it.
  if (::fdatasync(fd_) != 0) throw_errno("PackWriter: fsync " + tmp_path_, errno);
  pwrite_all(fd_, &h, sizeof(h), 0, "PackWriter: write header " + tmp_path_);
  if (::fsync(fd_) != 0) throw_errno("PackWriter: fsync " + tmp_path_, errno);
  if (::close(fd_) != 0) {
    fd_ = -1;
    int err = errno;
    ::unlink(tmp_path_.c_str());
    throw_errno("PackWriter: close " + tmp_path_, err);
  }
  fd_ = -1;
  if (::rename(tmp_path_.c_str(), path_.c_str()) != 0) {
    int err = errno;
    ::unlink(tmp_path_.c_str());
    throw_errno("PackWriter: rename " + tmp_path_ + " -> " + path_, err);
  }
  std::string d = dir_of(path_);
  int dfd = ::open(d.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {  // best effort: makes the rename itself durable
    ::fsync(dfd);
    ::close(dfd);
  }
  std::vector<char>().swap(buf_);
}

void PackWriter::abort() {
  if (stage_fd_ >= 0) ::close(stage_fd_);
  stage_fd_ = -1;
  if (fd_ < 0) return;
  ::close(fd_);
  fd_ = -1;
  ::unlink(tmp_path_.c_str());
}

}  // namespace shadecache
