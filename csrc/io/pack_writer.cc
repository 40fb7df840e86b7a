#include "io/pack_writer.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>

#include "common/crc32c.h"
#include "common/error.h"

namespace shadecache {
namespace {

constexpr size_t kBufBytes = 4 << 20;
const char kZeros[store::kAlign] = {};

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

}  // namespace

PackWriter::PackWriter(const std::string& path) : path_(path) {
  if (path.empty()) throw Error(ErrorKind::kInvalidArgument, "PackWriter: empty path");
  static std::atomic<unsigned> counter{0};
  // Same directory as the destination, so the final rename() is atomic (same file system).
  tmp_path_ = path + ".tmp." + std::to_string(::getpid()) + "." + std::to_string(counter++);
  fd_ = ::open(tmp_path_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd_ < 0) throw_errno("PackWriter: create " + tmp_path_, errno);
  buf_.resize(kBufBytes);
  // The header block stays zero until close(): a killed pack leaves a file with bad magic.
  write_all(kZeros, store::kHeaderBytes);
}

PackWriter::~PackWriter() { abort(); }

void PackWriter::check_open() const {
  if (fd_ < 0) throw Error(ErrorKind::kClosed, "PackWriter " + path_ + " is closed");
}

void PackWriter::flush() {
  pwrite_all(fd_, buf_.data(), buf_used_, pos_ - buf_used_, "PackWriter: write " + tmp_path_);
  buf_used_ = 0;
}

void PackWriter::write_all(const void* data, size_t n) {
  if (buf_used_ + n > buf_.size()) {
    flush();
    if (n > buf_.size()) {  // large sample: straight to the file, no copy through the buffer
      pwrite_all(fd_, data, n, pos_, "PackWriter: write " + tmp_path_);
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
    throw Error(ErrorKind::kTooLarge, "PackWriter: sample " + std::to_string(entries_.size()) +
                                          " has " + std::to_string(n) +
                                          " bytes; the format holds at most 4 GiB - 1 per sample");
  store::Entry e;
  e.offset = pos_;  // always aligned: every previous write ended on a kAlign boundary
  e.length = static_cast<uint32_t>(n);
  e.crc = crc32c(data, n);
  e.label = label;
  write_all(data, n);
  uint64_t pad = store::align_up(pos_) - pos_;
  write_all(kZeros, pad);
  entries_.push_back(e);
  return entries_.size() - 1;
}

void PackWriter::close(const std::string& meta) {
  check_open();
  store::Header h;
  std::memset(&h, 0, sizeof(h));
  std::memcpy(h.magic, store::kMagic, sizeof(h.magic));
  h.version = store::kVersion;
  h.header_bytes = store::kHeaderBytes;
  h.align = store::kAlign;
  h.entry_bytes = sizeof(store::Entry);
  h.num_samples = entries_.size();
  h.dir_offset = pos_;
  h.dir_bytes = entries_.size() * sizeof(store::Entry);
  h.dir_crc = crc32c(entries_.data(), h.dir_bytes);
  write_all(entries_.data(), h.dir_bytes);
  h.meta_offset = pos_;
  h.meta_bytes = meta.size();
  h.meta_crc = crc32c(meta.data(), meta.size());
  write_all(meta.data(), meta.size());
  h.file_bytes = pos_;
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
  std::string dir = dir_of(path_);
  int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {  // best effort: makes the rename itself durable
    ::fsync(dfd);
    ::close(dfd);
  }
  std::vector<char>().swap(buf_);
}

void PackWriter::abort() {
  if (fd_ < 0) return;
  ::close(fd_);
  fd_ = -1;
  ::unlink(tmp_path_.c_str());
}

}  // namespace shadecache
