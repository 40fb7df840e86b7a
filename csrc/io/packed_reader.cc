#include "io/packed_reader.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <memory>

#include "common/crc32c.h"
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
    load(fd);
    if (direct_) {
      struct stat st;
      if (::fstat(fd, &st) != 0) throw_errno("PackedStore: fstat " + path, errno);
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

void PackedReader::format_error(const std::string& why) const {
  throw Error(ErrorKind::kFormat, path_ + ": " + why);
}

void PackedReader::load(int fd) {
  struct stat st;
  if (::fstat(fd, &st) != 0) throw_errno("PackedStore: fstat " + path_, errno);
  uint64_t size = static_cast<uint64_t>(st.st_size);
  store::Header& h = header_;
  if (size < sizeof(h) || !pread_exact(fd, &h, sizeof(h), 0, path_))
    format_error("not a shadecache store: " + std::to_string(size) +
                 " bytes, shorter than the header");
  if (std::memcmp(h.magic, store::kMagic, sizeof(h.magic)) != 0)
    format_error("not a shadecache store (bad magic; an interrupted pack leaves a zero header)");
  if (h.version == 1)
    format_error("format version 1 (every sample padded to 4 KiB), but this shadecache reads "
                 "version 2: convert it with `shadecache pack " + path_ + " NEW.shc`");
  if (h.version != store::kVersion)
    format_error("format version " + std::to_string(h.version) + ", but this shadecache reads " +
                 "version " + std::to_string(store::kVersion) + " (repack the data set)");
  uint32_t hcrc = crc32c(&h, offsetof(store::Header, header_crc));
  if (hcrc != h.header_crc)
    format_error("header damaged: checksum " + hex32(hcrc) + " != stored " + hex32(h.header_crc));
  bool zero_reserved = h.reserved0 == 0 &&
                       std::all_of(std::begin(h.reserved), std::end(h.reserved),
                                   [](uint8_t b) { return b == 0; });
  if (h.header_bytes != store::kHeaderBytes ||
      (h.len_width != 1 && h.len_width != 2 && h.len_width != 4) ||
      (h.label_width != 1 && h.label_width != 2 && h.label_width != 4 && h.label_width != 8) ||
      h.placement > store::kShuffled || (h.placement == store::kAsWritten && h.placement_seed != 0) ||
      !zero_reserved)
    format_error("header has unsupported geometry (header_bytes " +
                 std::to_string(h.header_bytes) + ", len_width " + std::to_string(h.len_width) +
                 ", label_width " + std::to_string(h.label_width) + ", placement " +
                 std::to_string(h.placement) + ")");
  // Overflow-checked: a hostile header (its checksum is easy to recompute) must not make these
  // sums wrap, and nothing is allocated before the sizes are known to fit the real file.
  uint64_t dir_offset = 0, dir_bytes = 0, meta_offset = 0, file_bytes = 0;
  if (h.data_offset != h.header_bytes ||
      __builtin_add_overflow(h.data_offset, h.data_bytes, &dir_offset) || h.dir_offset != dir_offset ||
      __builtin_mul_overflow(h.num_samples, store::entry_bytes(h), &dir_bytes) ||
      __builtin_add_overflow(dir_bytes, uint64_t{store::kTrailerBytes}, &dir_bytes) ||
      h.dir_bytes != dir_bytes ||
      __builtin_add_overflow(h.dir_offset, h.dir_bytes, &meta_offset) || h.meta_offset != meta_offset ||
      __builtin_add_overflow(h.meta_offset, h.meta_bytes, &file_bytes) || h.file_bytes != file_bytes)
    format_error("header fields are inconsistent (directory at " + std::to_string(h.dir_offset) +
                 ", " + std::to_string(h.dir_bytes) + " bytes for " +
                 std::to_string(h.num_samples) + " samples)");
  if (size < h.file_bytes)
    format_error("truncated: the file has " + std::to_string(size) + " bytes, the header says " +
                 std::to_string(h.file_bytes) + " (the sample directory at offset " +
                 std::to_string(h.dir_offset) + " is " +
                 (size <= h.dir_offset ? "missing)" : "cut short)"));
  // Nothing the header claims is allocated before it has been read and checked in pieces. The
  // directory's trailer (its last 16 bytes) is checked first: a sparse file that claims gigabytes
  // of directory it never wrote has a hole there, and holes read as zeros. Pass 1 then streams
  // the directory and the metadata through one piece-sized buffer: the directory's checksum, its
  // lengths adding up to the data region, and metadata whose checksum holds and that has no NUL
  // byte (JSON text never does). Only then are they allocated and read again (and checked again:
  // the file may have changed).
  char trailer[store::kTrailerBytes];
  uint64_t trailer_n = 0;
  uint64_t trailer_at = h.dir_offset + h.dir_bytes - store::kTrailerBytes;
  if (!pread_exact(fd, trailer, sizeof(trailer), trailer_at, path_))
    format_error("truncated while reading the sample directory");
  std::memcpy(&trailer_n, trailer + sizeof(store::kDirMagic), sizeof(trailer_n));
  if (std::memcmp(trailer, store::kDirMagic, sizeof(store::kDirMagic)) != 0 || trailer_n != h.num_samples)
    format_error("sample directory damaged: its trailer at offset " + std::to_string(trailer_at) +
                 " is not there (a sparse or overwritten directory)");
  std::string first_error;
  scan_directory(fd, nullptr, &first_error);
  if (!first_error.empty()) format_error(first_error);
  scan_metadata(fd, nullptr, &first_error);
  if (!first_error.empty()) format_error(first_error);
  try {
    dir_.resize(h.num_samples);
    meta_.resize(h.meta_bytes);
  } catch (const std::bad_alloc&) {
    throw Error(ErrorKind::kCapacity, path_ + ": cannot hold the sample directory (" +
                                          std::to_string(h.num_samples * sizeof(store::Entry)) +
                                          " bytes in memory) and metadata (" +
                                          std::to_string(h.meta_bytes) + " bytes)");
  }
  scan_directory(fd, dir_.data(), &first_error);
  if (first_error.empty()) scan_metadata(fd, &meta_[0], &first_error);
  if (!first_error.empty()) format_error("changed while it was being opened: " + first_error);
  place_samples();
}

// Reads [off, off + bytes) in pieces of at most kPiece bytes, into dest when it is given (else
// through one scratch piece), and calls each(piece, n, index of its first byte) on every piece.
// Returns the crc32c of the whole region, chained from `crc`. False from `each` stops early (the
// crc is then partial).
template <typename Each>
uint32_t PackedReader::scan(int fd, uint64_t off, uint64_t bytes, char* dest, const char* what,
                            Each each, uint32_t crc) const {
  constexpr size_t kPiece = 131070 * 8;  // ~1 MiB, whole entries of every column width
  std::unique_ptr<char[]> scratch;
  if (dest == nullptr) scratch.reset(new char[std::min<uint64_t>(bytes, kPiece) + 1]);
  for (uint64_t done = 0; done < bytes;) {
    size_t n = static_cast<size_t>(std::min<uint64_t>(bytes - done, kPiece));
    char* piece = dest ? dest + done : scratch.get();
    if (!pread_exact(fd, piece, n, off + done, path_))
      format_error(std::string("truncated while reading the ") + what);
    crc = crc32c(piece, n, crc);
    if (!each(piece, n, done)) break;
    done += n;
  }
  return crc;
}

void PackedReader::scan_directory(int fd, store::Entry* dest, std::string* error) const {
  // Column by column, in file order, the checksum chained over all of them and the trailer.
  // Pass 1 (dest == nullptr) checks that the lengths add up to the data region (so the offsets
  // derived from them stay inside it); pass 2 also fills dest and checks each entry.
  const store::Header& h = header_;
  error->clear();
  const uint64_t n = h.num_samples;
  uint64_t off = h.dir_offset;
  uint64_t total = 0;
  bool overflow = false;
  std::string bad_entry;
  auto column = [](uint32_t width, auto put) {
    return [width, put](const char* piece, size_t len, uint64_t at) {
      for (size_t k = 0; k < len / width; ++k) put(at / width + k, piece + k * width);
      return true;
    };
  };
  uint32_t crc = 0;
  crc = scan(fd, off, n * h.len_width, nullptr, "sample directory",
             column(h.len_width, [&](uint64_t i, const char* p) {
               uint32_t v = 0;
               std::memcpy(&v, p, h.len_width);
               overflow |= __builtin_add_overflow(total, uint64_t{v}, &total);
               if (dest) dest[i].length = v;
             }), crc);
  off += n * h.len_width;
  crc = scan(fd, off, n * store::kCrcBytes, nullptr, "sample directory",
             column(store::kCrcBytes, [&](uint64_t i, const char* p) {
               uint32_t v;
               std::memcpy(&v, p, sizeof(v));
               if (!dest) return;
               dest[i].crc = v;
               // A 0-byte sample has the checksum of no bytes (0): any other value is a damaged
               // entry, never bytes handed out unchecked.
               if (dest[i].length == 0 && v != 0 && bad_entry.empty())
                 bad_entry = "sample directory damaged: entry " + std::to_string(i) +
                             " is invalid (length 0, checksum " + hex32(v) +
                             " where no bytes have checksum 0x00000000)";
             }), crc);
  off += n * store::kCrcBytes;
  crc = scan(fd, off, n * h.label_width, nullptr, "sample directory",
             column(h.label_width, [&](uint64_t i, const char* p) {
               if (!dest) return;
               int64_t v = 0;
               std::memcpy(&v, p, h.label_width);
               unsigned shift = 64 - 8 * h.label_width;  // sign-extend the stored width
               dest[i].label = shift ? static_cast<int64_t>(static_cast<uint64_t>(v) << shift) >> shift : v;
             }), crc);
  off += n * h.label_width;
  crc = scan(fd, off, store::kTrailerBytes, nullptr, "sample directory",
             [](const char*, size_t, uint64_t) { return true; }, crc);
  if (overflow || total != h.data_bytes)
    *error = "sample directory damaged: the sample lengths add up to " +
             (overflow ? std::string("more than 2^64") : std::to_string(total)) +
             " bytes, the data region has " + std::to_string(h.data_bytes);
  else if (!bad_entry.empty())
    *error = bad_entry;
  else if (crc != h.dir_crc)
    *error = "sample directory damaged: checksum " + hex32(crc) + " != stored " + hex32(h.dir_crc);
}

void PackedReader::place_samples() {
  // Offsets follow from the lengths in placement order (store_format.h); the lengths add up to
  // the data region (checked by scan_directory), so every sample lies inside it.
  const store::Header& h = header_;
  uint64_t at = h.data_offset;
  auto place = [&](uint64_t id) {
    dir_[id].offset = at;
    at += dir_[id].length;
  };
  if (h.placement == store::kShuffled) {
    for (uint64_t id : store::placement_order(h.num_samples, h.placement_seed)) place(id);
  } else {
    for (uint64_t id = 0; id < h.num_samples; ++id) place(id);
  }
}

std::vector<uint64_t> PackedReader::disk_order() const {
  const store::Header& h = header_;
  if (h.placement == store::kShuffled) return store::placement_order(h.num_samples, h.placement_seed);
  std::vector<uint64_t> ids(h.num_samples);
  for (uint64_t i = 0; i < ids.size(); ++i) ids[i] = i;
  return ids;
}

void PackedReader::scan_metadata(int fd, char* dest, std::string* error) const {
  const store::Header& h = header_;
  error->clear();
  uint64_t nul = UINT64_MAX;
  uint32_t mcrc = scan(fd, h.meta_offset, h.meta_bytes, dest, "metadata",
                       [&](const char* piece, size_t n, uint64_t at) {
    const void* z = std::memchr(piece, 0, n);
    if (z != nullptr) nul = at + static_cast<uint64_t>(static_cast<const char*>(z) - piece);
    return z == nullptr;
  }, 0);
  if (nul != UINT64_MAX)
    *error = "metadata is not JSON text (a NUL byte at offset " + std::to_string(h.meta_offset + nul) + ")";
  else if (mcrc != h.meta_crc)
    *error = "metadata damaged: checksum " + hex32(mcrc) + " != stored " + hex32(h.meta_crc);
}

const store::Entry& PackedReader::entry(int64_t id) const {
  if (id < 0 || static_cast<uint64_t>(id) >= dir_.size())
    throw Error(ErrorKind::kOutOfRange, "sample id " + std::to_string(id) + " out of range [0, " +
                                            std::to_string(dir_.size()) + ") of " + path_);
  return dir_[static_cast<size_t>(id)];
}

void PackedReader::read_into(const int64_t* ids, size_t n, char* const* dests) {
  std::shared_lock<std::shared_mutex> lk(io_mu_);
  check_open();
  CheckedBatch batch(dir_, ids, n, dests, verify_);
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
    total += dir_[static_cast<size_t>(first + k)].length;
  }
  std::unique_ptr<char[]> buf(new char[std::max<size_t>(total, 1)]);
  std::vector<char*> dests(ids.size());
  size_t at = 0;
  for (size_t k = 0; k < ids.size(); ++k) {
    dests[k] = buf.get() + at;
    at += dir_[static_cast<size_t>(ids[k])].length;
  }
  CheckedBatch batch(dir_, ids.data(), ids.size(), dests.data(), true);
  int fd = direct_ ? direct_fd_ : fd_;
  slot_.with([&](IoBackend& b) { read_samples(b, fd, direct_, batch, shape_, &counters_); });
  return batch.corrupt_ids();
}

}  // namespace shadecache
