#include "io/store_directory.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <new>

#include "common/crc32c.h"
#include "common/error.h"
#include "io/checked_batch.h"

namespace shadecache {

StoreDirectory::StoreDirectory(std::string name, uint64_t size, const RegionRead& read)
    : name_(std::move(name)), read_(&read) {
  store::Header& h = header_;
  if (size < sizeof(h) || !read(&h, sizeof(h), 0))
    format_error("not a shadecache store: " + std::to_string(size) +
                 " bytes, shorter than the header");
  h = check_header(name_, &h, sizeof(h), size);
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
  if (!read(trailer, sizeof(trailer), trailer_at))
    format_error("truncated while reading the sample directory");
  std::memcpy(&trailer_n, trailer + sizeof(store::kDirMagic), sizeof(trailer_n));
  if (std::memcmp(trailer, store::kDirMagic, sizeof(store::kDirMagic)) != 0 || trailer_n != h.num_samples)
    format_error("sample directory damaged: its trailer at offset " + std::to_string(trailer_at) +
                 " is not there (a sparse or overwritten directory)");
  std::string first_error;
  scan_directory(nullptr, &first_error);
  if (!first_error.empty()) format_error(first_error);
  scan_metadata(nullptr, &first_error);
  if (!first_error.empty()) format_error(first_error);
  try {
    dir_.resize(h.num_samples);
    meta_.resize(h.meta_bytes);
  } catch (const std::bad_alloc&) {
    throw Error(ErrorKind::kCapacity, name_ + ": cannot hold the sample directory (" +
                                          std::to_string(h.num_samples * sizeof(store::Entry)) +
                                          " bytes in memory) and metadata (" +
                                          std::to_string(h.meta_bytes) + " bytes)");
  }
  scan_directory(dir_.data(), &first_error);
  if (first_error.empty()) scan_metadata(&meta_[0], &first_error);
  if (!first_error.empty()) format_error("changed while it was being opened: " + first_error);
  place_samples();
  read_ = nullptr;
}

void StoreDirectory::format_error(const std::string& why) const {
  throw Error(ErrorKind::kFormat, name_ + ": " + why);
}

store::Header StoreDirectory::check_header(const std::string& name, const void* bytes, size_t n,
                                           uint64_t size) {
  auto fail = [&](const std::string& why) { throw Error(ErrorKind::kFormat, name + ": " + why); };
  store::Header h;
  if (n < sizeof(h) || size < sizeof(h))
    fail("not a shadecache store: " + std::to_string(size) + " bytes, shorter than the header");
  std::memcpy(&h, bytes, sizeof(h));
  if (std::memcmp(h.magic, store::kMagic, sizeof(h.magic)) != 0)
    fail("not a shadecache store (bad magic; an interrupted pack leaves a zero header)");
  if (h.version == 1)
    fail("format version 1 (every sample padded to 4 KiB), but this shadecache reads "
         "version 2: convert it with `shadecache pack " + name + " NEW.shc`");
  if (h.version != store::kVersion)
    fail("format version " + std::to_string(h.version) + ", but this shadecache reads " +
         "version " + std::to_string(store::kVersion) + " (repack the data set)");
  uint32_t hcrc = crc32c(&h, offsetof(store::Header, header_crc));
  if (hcrc != h.header_crc)
    fail("header damaged: checksum " + hex32(hcrc) + " != stored " + hex32(h.header_crc));
  bool zero_reserved = h.reserved0 == 0 &&
                       std::all_of(std::begin(h.reserved), std::end(h.reserved),
                                   [](uint8_t b) { return b == 0; });
  if (h.header_bytes != store::kHeaderBytes ||
      (h.len_width != 1 && h.len_width != 2 && h.len_width != 4) ||
      (h.label_width != 1 && h.label_width != 2 && h.label_width != 4 && h.label_width != 8) ||
      h.placement > store::kShuffled || (h.placement == store::kAsWritten && h.placement_seed != 0) ||
      !zero_reserved)
    fail("header has unsupported geometry (header_bytes " + std::to_string(h.header_bytes) +
         ", len_width " + std::to_string(h.len_width) + ", label_width " +
         std::to_string(h.label_width) + ", placement " + std::to_string(h.placement) + ")");
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
    fail("header fields are inconsistent (directory at " + std::to_string(h.dir_offset) + ", " +
         std::to_string(h.dir_bytes) + " bytes for " + std::to_string(h.num_samples) + " samples)");
  if (size < h.file_bytes)
    fail("truncated: the file has " + std::to_string(size) + " bytes, the header says " +
         std::to_string(h.file_bytes) + " (the sample directory at offset " +
         std::to_string(h.dir_offset) + " is " + (size <= h.dir_offset ? "missing)" : "cut short)"));
  return h;
}

// Reads [off, off + bytes) in pieces of at most kPiece bytes, into dest when it is given (else
// through one scratch piece), and calls each(piece, n, index of its first byte) on every piece.
// Returns the crc32c of the whole region, chained from `crc`. False from `each` stops early (the
// crc is then partial).
template <typename Each>
uint32_t StoreDirectory::scan(uint64_t off, uint64_t bytes, char* dest, const char* what, Each each,
                              uint32_t crc) const {
  constexpr size_t kPiece = 131070 * 8;  // ~1 MiB, whole entries of every column width
  std::unique_ptr<char[]> scratch;
  if (dest == nullptr) scratch.reset(new char[std::min<uint64_t>(bytes, kPiece) + 1]);
  for (uint64_t done = 0; done < bytes;) {
    size_t n = static_cast<size_t>(std::min<uint64_t>(bytes - done, kPiece));
    char* piece = dest ? dest + done : scratch.get();
    if (!(*read_)(piece, n, off + done)) format_error(std::string("truncated while reading the ") + what);
    crc = crc32c(piece, n, crc);
    if (!each(piece, n, done)) break;
    done += n;
  }
  return crc;
}

void StoreDirectory::scan_directory(store::Entry* dest, std::string* error) const {
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
  crc = scan(off, n * h.len_width, nullptr, "sample directory",
             column(h.len_width, [&](uint64_t i, const char* p) {
               uint32_t v = 0;
               std::memcpy(&v, p, h.len_width);
               overflow |= __builtin_add_overflow(total, uint64_t{v}, &total);
               if (dest) dest[i].length = v;
             }), crc);
  off += n * h.len_width;
  crc = scan(off, n * store::kCrcBytes, nullptr, "sample directory",
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
  crc = scan(off, n * h.label_width, nullptr, "sample directory",
             column(h.label_width, [&](uint64_t i, const char* p) {
               if (!dest) return;
               int64_t v = 0;
               std::memcpy(&v, p, h.label_width);
               unsigned shift = 64 - 8 * h.label_width;  // sign-extend the stored width
               dest[i].label = shift ? static_cast<int64_t>(static_cast<uint64_t>(v) << shift) >> shift : v;
             }), crc);
  off += n * h.label_width;
  crc = scan(off, store::kTrailerBytes, nullptr, "sample directory",
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

void StoreDirectory::place_samples() {
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

std::vector<uint64_t> StoreDirectory::disk_order() const {
  const store::Header& h = header_;
  if (h.placement == store::kShuffled) return store::placement_order(h.num_samples, h.placement_seed);
  std::vector<uint64_t> ids(h.num_samples);
  for (uint64_t i = 0; i < ids.size(); ++i) ids[i] = i;
  return ids;
}

void StoreDirectory::scan_metadata(char* dest, std::string* error) const {
  const store::Header& h = header_;
  error->clear();
  uint64_t nul = UINT64_MAX;
  uint32_t mcrc = scan(h.meta_offset, h.meta_bytes, dest, "metadata",
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

const store::Entry& StoreDirectory::entry(int64_t id) const {
  if (id < 0 || static_cast<uint64_t>(id) >= dir_.size())
    throw Error(ErrorKind::kOutOfRange, "sample id " + std::to_string(id) + " out of range [0, " +
                                            std::to_string(dir_.size()) + ") of " + name_);
  return dir_[static_cast<size_t>(id)];
}

}  // namespace shadecache
