// The peer protocol's framing, the native twin of shadecache/peer/wire.py (which documents the
// format). The two must agree: _core.WIRE exports these constants and
// tests/peer/test_peer_wire.py holds wire.py to them; the peer tests run both sides together.
#pragma once

#include <cstdint>
#include <cstring>

namespace shadecache::net {

constexpr uint8_t kVersion = 3;
// opcodes
constexpr uint8_t kHello = 1, kProof = 2, kGet = 3, kGetReply = 4, kPing = 5, kPong = 6, kError = 7, kStats = 8,
                  kStatsReply = 9;
// status codes of an ERROR message
constexpr uint16_t kEBadMagic = 1, kEBadVersion = 2, kEBadOpcode = 3, kETooLarge = 4, kEBadLength = 5, kEAuth = 6,
                   kEBadId = 7, kEInternal = 8, kEDataSet = 9, kEBusy = 10;
constexpr uint16_t kMore = 1;  // GET_REPLY status: more chunks of this request follow
constexpr uint32_t kMaxBatch = 4096;
constexpr uint32_t kMaxValue = 64u << 20;
constexpr uint32_t kEntryBytes = 16;
// One GET_REPLY message: a chunk of at most the server's chunk bound, or one value alone.
constexpr uint64_t kMaxReply = uint64_t{kMaxValue} + uint64_t{kMaxBatch} * kEntryBytes;
constexpr uint32_t kMaxError = 1024;
constexpr uint32_t kMaxStats = 4096;
constexpr uint32_t kMiss = 0xFFFFFFFFu;

#pragma pack(push, 1)
struct Header {
  char magic[4];
  uint8_t version;
  uint8_t opcode;
  uint16_t status;
  uint32_t count;
  uint32_t body_len;
  uint64_t opaque;
};
struct Entry {
  uint64_t id;
  uint32_t length;
  uint32_t crc;
};
#pragma pack(pop)
static_assert(sizeof(Header) == 24 && sizeof(Entry) == kEntryBytes, "wire layout");

inline Header make_header(uint8_t opcode, uint32_t count, uint32_t body_len, uint64_t opaque, uint16_t status) {
  Header h;
  std::memcpy(h.magic, "SHCP", 4);
  h.version = kVersion;
  h.opcode = opcode;
  h.status = status;
  h.count = count;
  h.body_len = body_len;
  h.opaque = opaque;
  return h;
}

}  // namespace shadecache::net
