// The keys of one peer connection, from the shared secret, both handshake nonces and the data
// set's identity (shadecache/peer/auth.py runs the handshake; docs/peer.md has the threat model):
//
//   PRK    = HKDF-Extract(salt = server nonce || client nonce, IKM = secret)        (RFC 5869)
//   output = HKDF-Expand(PRK, info = label || fingerprint (32) || num_samples (u64 le), 128)
//          = client proof (32) | server proof (32) | client->server key (32) | server->client key (32)
//
// Every output changes with either nonce (no replay), the two proofs differ (no reflection), and a
// side that names another data set derives other keys. HKDF-SHA256 is libcrypto's.
#pragma once

#include <cstddef>
#include <cstdint>

namespace shadecache::net {

constexpr size_t kSessionKeyBytes = 128;

// false when libcrypto fails.
bool derive_session_keys(const uint8_t* secret, size_t secret_len, const uint8_t* salt, size_t salt_len,
                         const uint8_t* info, size_t info_len, uint8_t out[kSessionKeyBytes]);

}  // namespace shadecache::net
