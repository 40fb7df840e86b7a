// One direction of a peer connection's authenticated encryption: AES-256-GCM, a 32-byte key that
// the handshake derived for this direction alone (session_keys.h), and the record's sequence
// number as its nonce.
//
// Two implementations of the same standard cipher, chosen once per process (implementation()):
// Intel's intel-ipsec-mb (libIPSec_MB, when the build found it and it passes a known-answer check
// against libcrypto at start: on CPUs with VAES/VPCLMULQDQ its GCM works on several blocks per
// instruction and seals much faster than OpenSSL 3.0's AES-NI code; docs/peer.md, "Not done
// (yet)"), otherwise OpenSSL's libcrypto (EVP). Records of either open with the other;
// SHADECACHE_AEAD=openssl forces libcrypto.
//
// A record is sealed (or opened) in one pass that may be split over many update() calls, so a
// large value is encrypted or decrypted piece by piece as it goes to or comes from the socket.
// Every record takes the next sequence number of its direction (nonce = 4 zero bytes || seq,
// big endian): a nonce is never used twice under one key, and a record that is dropped, replayed
// or reordered fails its tag at the receiver. Nothing a record carries may be used before
// open_end() has returned true.
//
// Contract: no Python, no allocation after construction; one thread at a time per object. A
// false return means the cipher call failed (or, for open_end, the tag did not match): the
// connection must be dropped.
#pragma once

#include <cstddef>
#include <cstdint>

typedef struct evp_cipher_ctx_st EVP_CIPHER_CTX;

namespace shadecache::net {

class Aead {
 public:
  static constexpr size_t kKeyBytes = 32;
  static constexpr size_t kTagBytes = 16;
  static constexpr size_t kNonceBytes = 12;

  // seal = true: this side encrypts with `key`; false: it decrypts. Throws std::runtime_error when
  // libcrypto cannot set the cipher up.
  Aead(const uint8_t* key, bool seal);
  ~Aead();
  Aead(const Aead&) = delete;
  Aead& operator=(const Aead&) = delete;

  // Starts the next record (sequence number seq(), then incremented) with `aad` authenticated but
  // not encrypted (the frame header; may be empty).
  bool begin(const void* aad, size_t aad_len);
  // Encrypts (seal) or decrypts (open) n bytes; `out` may equal `in` (in place).
  bool update(const void* in, void* out, size_t n);
  // Ends a sealed record: writes its tag.
  bool seal_end(uint8_t* tag);
  // Ends an opened record: true only when `tag` authenticates the aad and every byte updated.
  bool open_end(const uint8_t* tag);
  uint64_t seq() const { return seq_; }
  // "intel-ipsec-mb (avx512)" or "openssl": what this process seals and opens with.
  static const char* implementation();

 private:
  struct Imb;                        // intel-ipsec-mb's key schedule and running state, when used
  EVP_CIPHER_CTX* ctx_ = nullptr;    // otherwise libcrypto's
  Imb* imb_ = nullptr;
  bool seal_;
  uint64_t seq_ = 0;
};

}  // namespace shadecache::net
