// SHA-256 and HMAC-SHA256 (FIPS 180-4, RFC 2104) for the handshake's proof of the job token, and
// random nonces. Internal to the runtime.
#pragma once
#include <array>
#include <cstddef>
#include <cstdint>
#include <string>

namespace kungfu::auth {

using Digest = std::array<uint8_t, 32>;

class Sha256 {
 public:
  Sha256();
  void Update(const void* data, size_t n);
  Digest Finish();

 private:
  void Block(const uint8_t* p);
  uint32_t h_[8];
  uint8_t buf_[64];
  size_t buf_len_ = 0;
  uint64_t total_ = 0;
};

Digest HmacSha256(const std::string& key, const std::string& message);
// Compares without an early exit, so the time taken says nothing about where they differ.
bool Equal(const Digest& a, const Digest& b);
// 32 bytes from the kernel's random source (getrandom, else /dev/urandom); false if neither
// gives them.
bool Nonce(Digest* out);
std::string Hex(const Digest& d);

}  // namespace kungfu::auth
