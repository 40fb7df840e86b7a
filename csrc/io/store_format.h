// The on-disk format of a packed sample store (".shc"), version 1. docs/store_format.md describes
// it for readers; this header is the one place the code defines it (the writer and the reader
// both include it, Python never parses the file itself).
//
//   offset 0          Header (4096 bytes; 128 used, the rest zero)
//   offset 4096       sample 0, zero-padded to a multiple of 4096
//   ...               sample i starts at a multiple of 4096, so O_DIRECT can read it in place
//   dir_offset        the sample directory: num_samples x Entry (24 bytes each)
//   meta_offset       optional metadata, UTF-8 JSON (class names, source), may be empty
//   file_bytes        end of file
//
// The header is written last, at offset 0 of a temporary file that is then fsync'ed and renamed
// into place, so a pack interrupted at any point leaves a file whose header is all zeros (bad
// magic) under a temporary name, never a store that opens as valid.
// All integers are little-endian (the only byte order this code runs on; checked below).
#pragma once

#include <cstddef>
#include <cstdint>

namespace shadecache {
namespace store {

constexpr char kMagic[8] = {'S', 'H', 'D', 'C', 'P', 'A', 'C', 'K'};
constexpr uint32_t kVersion = 1;
constexpr uint32_t kAlign = 4096;          // sample alignment == O_DIRECT block granularity
constexpr uint32_t kHeaderBytes = 4096;    // the header occupies the first aligned block
constexpr uint64_t kMaxSampleBytes = 0xFFFFFFFFull;  // Entry::length is 32-bit

// One sample in the directory. 24 bytes, no padding.
struct Entry {
  uint64_t offset;  // byte offset of the sample in the file, a multiple of kAlign
  uint32_t length;  // exact sample length in bytes (padding excluded)
  uint32_t crc;     // crc32c of the sample's `length` bytes
  int64_t label;    // class label given at pack time
};
static_assert(sizeof(Entry) == 24, "Entry layout is part of the file format");

struct Header {
  char magic[8];         //  0
  uint32_t version;      //  8  checked before anything else after the magic
  uint32_t header_bytes; // 12  == kHeaderBytes
  uint32_t align;        // 16  == kAlign
  uint32_t entry_bytes;  // 20  == sizeof(Entry)
  uint64_t num_samples;  // 24
  uint64_t dir_offset;   // 32  multiple of kAlign
  uint64_t dir_bytes;    // 40  == num_samples * sizeof(Entry)
  uint32_t dir_crc;      // 48  crc32c of the directory bytes
  uint32_t meta_crc;     // 52  crc32c of the metadata bytes
  uint64_t meta_offset;  // 56  == dir_offset + dir_bytes
  uint64_t meta_bytes;   // 64
  uint64_t file_bytes;   // 72  == meta_offset + meta_bytes; a shorter file is truncated
  uint8_t reserved[44];  // 80  zero
  uint32_t header_crc;   // 124 crc32c of bytes [0, 124)
};
static_assert(sizeof(Header) == 128, "Header layout is part of the file format");
static_assert(offsetof(Header, version) == 8, "version must stay at offset 8 in every version");
static_assert(offsetof(Header, header_crc) == 124, "header_crc covers the 124 bytes before it");
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "the format is little-endian");

inline uint64_t align_up(uint64_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

}  // namespace store
}  // namespace shadecache
