#include "net/aead.h"

#include <openssl/evp.h>

#include <climits>
#include <stdexcept>

namespace shadecache::net {

Aead::Aead(const uint8_t* key, bool seal) : ctx_(EVP_CIPHER_CTX_new()), seal_(seal) {
  if (!ctx_ || EVP_CipherInit_ex(ctx_, EVP_aes_256_gcm(), nullptr, key, nullptr, seal ? 1 : 0) != 1 ||
      EVP_CIPHER_CTX_ctrl(ctx_, EVP_CTRL_GCM_SET_IVLEN, static_cast<int>(kNonceBytes), nullptr) != 1) {
    EVP_CIPHER_CTX_free(ctx_);
    throw std::runtime_error("libcrypto: cannot set up AES-256-GCM");
  }
}

Aead::~Aead() { EVP_CIPHER_CTX_free(ctx_); }

bool Aead::begin(const void* aad, size_t aad_len) {
  uint8_t nonce[kNonceBytes] = {0};
  uint64_t s = seq_++;
  for (int k = 0; k < 8; ++k) nonce[11 - k] = static_cast<uint8_t>(s >> (8 * k));
  // Only the nonce changes: the key schedule stays from the constructor.
  if (EVP_CipherInit_ex(ctx_, nullptr, nullptr, nullptr, nonce, seal_ ? 1 : 0) != 1) return false;
  int outl = 0;
  return aad_len == 0 ||
         EVP_CipherUpdate(ctx_, nullptr, &outl, static_cast<const unsigned char*>(aad), static_cast<int>(aad_len)) == 1;
}

bool Aead::update(const void* in, void* out, size_t n) {
  const auto* src = static_cast<const unsigned char*>(in);
  auto* dst = static_cast<unsigned char*>(out);
  while (n) {  // EVP takes an int length
    int step = static_cast<int>(n > (1u << 30) ? (1u << 30) : n);
    int outl = 0;
    if (EVP_CipherUpdate(ctx_, dst, &outl, src, step) != 1 || outl != step) return false;
    src += step;
    dst += step;
    n -= static_cast<size_t>(step);
  }
  return true;
}

bool Aead::seal_end(uint8_t* tag) {
  int outl = 0;
  unsigned char tail[16];
  return EVP_CipherFinal_ex(ctx_, tail, &outl) == 1 && outl == 0 &&
         EVP_CIPHER_CTX_ctrl(ctx_, EVP_CTRL_GCM_GET_TAG, static_cast<int>(kTagBytes), tag) == 1;
}

bool Aead::open_end(const uint8_t* tag) {
  int outl = 0;
  unsigned char tail[16];
  if (EVP_CIPHER_CTX_ctrl(ctx_, EVP_CTRL_GCM_SET_TAG, static_cast<int>(kTagBytes), const_cast<uint8_t*>(tag)) != 1)
    return false;
  return EVP_CipherFinal_ex(ctx_, tail, &outl) == 1 && outl == 0;  // 1 only when the tag matches
}

}  // namespace shadecache::net
