#include "net/aead.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>

#include <climits>
#include <cstdlib>
#include <cstring>
#include <stdexcept>

#ifdef SHADECACHE_HAVE_IPSEC_MB
#include <intel-ipsec-mb.h>
#endif

namespace shadecache::net {

namespace {

void nonce_of(uint64_t seq, uint8_t nonce[Aead::kNonceBytes]) {
  std::memset(nonce, 0, Aead::kNonceBytes);
  for (int k = 0; k < 8; ++k) nonce[Aead::kNonceBytes - 1 - k] = static_cast<uint8_t>(seq >> (8 * k));
}

}  // namespace

#ifdef SHADECACHE_HAVE_IPSEC_MB

namespace {

struct GcmState {
  gcm_key_data key;  // the expanded key and GHASH key powers (64-byte aligned: operator new honours it)
  gcm_context_data ctx;
};

// One AES-256-GCM record of `n` bytes sealed by libcrypto: ciphertext || tag into out[n + 16].
bool evp_seal_once(const uint8_t* key, const uint8_t* nonce, const uint8_t* aad, int aad_len, const uint8_t* in,
                   int n, uint8_t* out) {
  EVP_CIPHER_CTX* c = EVP_CIPHER_CTX_new();
  int l = 0;
  bool ok = c && EVP_EncryptInit_ex(c, EVP_aes_256_gcm(), nullptr, key, nonce) == 1 &&
            EVP_EncryptUpdate(c, nullptr, &l, aad, aad_len) == 1 && EVP_EncryptUpdate(c, out, &l, in, n) == 1 &&
            EVP_EncryptFinal_ex(c, out + n, &l) == 1 &&
            EVP_CIPHER_CTX_ctrl(c, EVP_CTRL_GCM_GET_TAG, static_cast<int>(Aead::kTagBytes), out + n) == 1;
  EVP_CIPHER_CTX_free(c);
  return ok;
}

// The same record sealed by intel-ipsec-mb, in two updates of unequal, unaligned lengths (the
// partial-block path that frames of many values take).
void imb_seal_once(IMB_MGR* m, const uint8_t* key, const uint8_t* nonce, const uint8_t* aad, uint64_t aad_len,
                   const uint8_t* in, uint64_t n, uint8_t* out) {
  auto* s = new GcmState;
  IMB_AES256_GCM_PRE(m, key, &s->key);
  IMB_AES256_GCM_INIT(m, &s->key, &s->ctx, nonce, aad, aad_len);
  IMB_AES256_GCM_ENC_UPDATE(m, &s->key, &s->ctx, out, in, 37);
  IMB_AES256_GCM_ENC_UPDATE(m, &s->key, &s->ctx, out + 37, in + 37, n - 37);
  IMB_AES256_GCM_ENC_FINALIZE(m, &s->key, &s->ctx, out + n, Aead::kTagBytes);
  OPENSSL_cleanse(s, sizeof *s);
  delete s;
}

// The manager only holds the function table init_mb_mgr_auto chose for this CPU: the GCM
// functions keep their whole state in the caller's key and context structs, so every thread
// shares it. nullptr: use libcrypto (not built in, forced by SHADECACHE_AEAD=openssl, no AES-NI,
// or a known-answer record that does not match libcrypto's to the byte).
IMB_MGR* imb_manager() {
  static IMB_MGR* const manager = []() -> IMB_MGR* {
    const char* force = std::getenv("SHADECACHE_AEAD");
    if (force && std::strcmp(force, "openssl") == 0) return nullptr;
    IMB_MGR* m = alloc_mb_mgr(0);
    if (!m) return nullptr;
    IMB_ARCH arch = IMB_ARCH_NONE;
    init_mb_mgr_auto(m, &arch);
    bool ok = arch >= IMB_ARCH_SSE;  // AES-NI and PCLMULQDQ at least
    if (ok) {
      uint8_t key[32], nonce[Aead::kNonceBytes], aad[24], in[1000], a[1000 + Aead::kTagBytes], b[1000 + Aead::kTagBytes];
      for (size_t k = 0; k < sizeof key; ++k) key[k] = static_cast<uint8_t>(k * 7 + 1);
      for (size_t k = 0; k < sizeof aad; ++k) aad[k] = static_cast<uint8_t>(k * 13 + 5);
      for (size_t k = 0; k < sizeof in; ++k) in[k] = static_cast<uint8_t>(k * 31 + k / 7);
      nonce_of(0x0102030405060708ull, nonce);
      imb_seal_once(m, key, nonce, aad, sizeof aad, in, sizeof in, a);
      ok = evp_seal_once(key, nonce, aad, sizeof aad, in, sizeof in, b) && std::memcmp(a, b, sizeof a) == 0;
    }
    if (!ok) {
      free_mb_mgr(m);
      return nullptr;
    }
    return m;
  }();
  return manager;
}

}  // namespace

struct Aead::Imb : GcmState {};

const char* Aead::implementation() {
  IMB_MGR* m = imb_manager();
  if (!m) return "openssl";
  switch (m->used_arch) {
    case IMB_ARCH_AVX512: return "intel-ipsec-mb (avx512)";
    case IMB_ARCH_AVX2: return "intel-ipsec-mb (avx2)";
    case IMB_ARCH_AVX: return "intel-ipsec-mb (avx)";
    default: return "intel-ipsec-mb (sse)";
  }
}

#else  // no intel-ipsec-mb in this build

struct Aead::Imb {};
const char* Aead::implementation() { return "openssl"; }

#endif

Aead::Aead(const uint8_t* key, bool seal) : seal_(seal) {
#ifdef SHADECACHE_HAVE_IPSEC_MB
  if (IMB_MGR* m = imb_manager()) {
    imb_ = new Imb;
    IMB_AES256_GCM_PRE(m, key, &imb_->key);
    return;
  }
#endif
  ctx_ = EVP_CIPHER_CTX_new();
  if (!ctx_ || EVP_CipherInit_ex(ctx_, EVP_aes_256_gcm(), nullptr, key, nullptr, seal ? 1 : 0) != 1 ||
      EVP_CIPHER_CTX_ctrl(ctx_, EVP_CTRL_GCM_SET_IVLEN, static_cast<int>(kNonceBytes), nullptr) != 1) {
    EVP_CIPHER_CTX_free(ctx_);
    throw std::runtime_error("libcrypto: cannot set up AES-256-GCM");
  }
}

Aead::~Aead() {
  if (imb_) {
    OPENSSL_cleanse(imb_, sizeof *imb_);  // the key schedule
    delete imb_;
  }
  EVP_CIPHER_CTX_free(ctx_);
}

bool Aead::begin(const void* aad, size_t aad_len) {
  uint8_t nonce[kNonceBytes];
  nonce_of(seq_++, nonce);
#ifdef SHADECACHE_HAVE_IPSEC_MB
  if (imb_) {
    IMB_AES256_GCM_INIT(imb_manager(), &imb_->key, &imb_->ctx, nonce, aad_len ? static_cast<const uint8_t*>(aad) : nullptr,
                        aad_len);
    return true;
  }
#endif
  // Only the nonce changes: the key schedule stays from the constructor.
  if (EVP_CipherInit_ex(ctx_, nullptr, nullptr, nullptr, nonce, seal_ ? 1 : 0) != 1) return false;
  int outl = 0;
  return aad_len == 0 ||
         EVP_CipherUpdate(ctx_, nullptr, &outl, static_cast<const unsigned char*>(aad), static_cast<int>(aad_len)) == 1;
}

bool Aead::update(const void* in, void* out, size_t n) {
  const auto* src = static_cast<const unsigned char*>(in);
  auto* dst = static_cast<unsigned char*>(out);
#ifdef SHADECACHE_HAVE_IPSEC_MB
  if (imb_) {
    if (n == 0) return true;  // the library refuses empty updates; an empty one changes nothing
    if (seal_)
      IMB_AES256_GCM_ENC_UPDATE(imb_manager(), &imb_->key, &imb_->ctx, dst, src, n);
    else
      IMB_AES256_GCM_DEC_UPDATE(imb_manager(), &imb_->key, &imb_->ctx, dst, src, n);
    return true;
  }
#endif
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
#ifdef SHADECACHE_HAVE_IPSEC_MB
  if (imb_) {
    IMB_AES256_GCM_ENC_FINALIZE(imb_manager(), &imb_->key, &imb_->ctx, tag, kTagBytes);
    return true;
  }
#endif
  int outl = 0;
  unsigned char tail[16];
  return EVP_CipherFinal_ex(ctx_, tail, &outl) == 1 && outl == 0 &&
         EVP_CIPHER_CTX_ctrl(ctx_, EVP_CTRL_GCM_GET_TAG, static_cast<int>(kTagBytes), tag) == 1;
}

bool Aead::open_end(const uint8_t* tag) {
#ifdef SHADECACHE_HAVE_IPSEC_MB
  if (imb_) {
    uint8_t expected[kTagBytes];
    IMB_AES256_GCM_DEC_FINALIZE(imb_manager(), &imb_->key, &imb_->ctx, expected, kTagBytes);
    bool match = CRYPTO_memcmp(expected, tag, kTagBytes) == 0;  // constant time
    OPENSSL_cleanse(expected, sizeof expected);
    return match;
  }
#endif
  int outl = 0;
  unsigned char tail[16];
  if (EVP_CIPHER_CTX_ctrl(ctx_, EVP_CTRL_GCM_SET_TAG, static_cast<int>(kTagBytes), const_cast<uint8_t*>(tag)) != 1)
    return false;
  return EVP_CipherFinal_ex(ctx_, tail, &outl) == 1 && outl == 0;  // 1 only when the tag matches
}

}  // namespace shadecache::net
