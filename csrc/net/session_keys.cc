#include "net/session_keys.h"

#include <openssl/evp.h>
#include <openssl/kdf.h>

namespace shadecache::net {

bool derive_session_keys(const uint8_t* secret, size_t secret_len, const uint8_t* salt, size_t salt_len,
                         const uint8_t* info, size_t info_len, uint8_t out[kSessionKeyBytes]) {
  EVP_PKEY_CTX* ctx = EVP_PKEY_CTX_new_id(EVP_PKEY_HKDF, nullptr);
  size_t len = kSessionKeyBytes;
  bool ok = ctx && EVP_PKEY_derive_init(ctx) == 1 && EVP_PKEY_CTX_set_hkdf_md(ctx, EVP_sha256()) == 1 &&
            EVP_PKEY_CTX_set1_hkdf_salt(ctx, salt, static_cast<int>(salt_len)) == 1 &&
            EVP_PKEY_CTX_set1_hkdf_key(ctx, secret, static_cast<int>(secret_len)) == 1 &&
            EVP_PKEY_CTX_add1_hkdf_info(ctx, info, static_cast<int>(info_len)) == 1 &&
            EVP_PKEY_derive(ctx, out, &len) == 1 && len == kSessionKeyBytes;
  EVP_PKEY_CTX_free(ctx);
  return ok;
}

}  // namespace shadecache::net
