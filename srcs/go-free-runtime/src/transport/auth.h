// The handshake's cryptography, from OpenSSL's libcrypto (never written here): HMAC-SHA256 for
// the proof of the job token, constant-time comparison of proofs, random nonces. Internal to the
// runtime.
#pragma once
#include <array>
#include <cstddef>
#include <cstdint>
#include <string>

namespace kungfu::auth {

using Digest = std::array<uint8_t, 32>;

// SHA-256 of `data` (FIPS 180-4); false if libcrypto cannot compute it (no digest is made up).
bool Sha256(const std::string& data, Digest* out);
// HMAC-SHA256 (RFC 2104) of `message` under `key`; false if libcrypto cannot compute it.
bool HmacSha256(const std::string& key, const std::string& message, Digest* out);
// Compares in constant time (CRYPTO_memcmp): the time taken says nothing about where they differ.
bool Equal(const Digest& a, const Digest& b);
// 32 bytes from libcrypto's CSPRNG (seeded by the kernel, reseeded after fork); false if it
// cannot give them.
bool Nonce(Digest* out);
std::string Hex(const Digest& d);

}  // namespace kungfu::auth
