#include "transport/auth.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>

#include <climits>

namespace kungfu::auth {

bool Sha256(const std::string& data, Digest* out) {
  unsigned int len = 0;
  return EVP_Digest(data.data(), data.size(), out->data(), &len, EVP_sha256(), nullptr) == 1 &&
         len == out->size();
}

bool HmacSha256(const std::string& key, const std::string& message, Digest* out) {
  if (key.size() > INT_MAX) return false;  // HMAC takes the key's length as an int
  unsigned int len = 0;
  return HMAC(EVP_sha256(), key.data(), static_cast<int>(key.size()),
              reinterpret_cast<const unsigned char*>(message.data()), message.size(), out->data(),
              &len) != nullptr &&
         len == out->size();
}

bool Equal(const Digest& a, const Digest& b) {
  return CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
}

bool Nonce(Digest* out) { return RAND_bytes(out->data(), static_cast<int>(out->size())) == 1; }

std::string Hex(const Digest& d) {
  static const char* digits = "0123456789abcdef";
  std::string s;
  for (uint8_t b : d) {
    s += digits[b >> 4];
    s += digits[b & 15];
  }
  return s;
}

}  // namespace kungfu::auth
