#include "flotilla/base/hashes.h"

#include <fcntl.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/rand.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <memory>
#include <vector>

#include "flotilla/error.h"

namespace flotilla::base {
namespace {

struct ContextDeleter {
  void operator()(EVP_MD_CTX* context) const { EVP_MD_CTX_free(context); }
};
using Context = std::unique_ptr<EVP_MD_CTX, ContextDeleter>;

// OpenSSL reports failures only as a return code; they mean no memory or a broken library.
void check(int ok, const char* what) {
  if (ok != 1) throw CheckpointError(std::string("SHA-256: OpenSSL's ") + what + " failed");
}

Context start() {
  Context context(EVP_MD_CTX_new());
  if (!context) throw CheckpointError("SHA-256: OpenSSL could not allocate a digest context");
  check(EVP_DigestInit_ex(context.get(), EVP_sha256(), nullptr), "EVP_DigestInit_ex");
  return context;
}

std::string finish(EVP_MD_CTX* context) {
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int length = 0;
  check(EVP_DigestFinal_ex(context, digest, &length), "EVP_DigestFinal_ex");
  return to_hex(digest, length);
}

} // namespace

std::string to_hex(const void* data, std::size_t size) {
  static const char kHex[] = "0123456789abcdef";
  const auto* bytes = static_cast<const unsigned char*>(data);
  std::string out;
  out.reserve(2 * size);
  for (std::size_t i = 0; i < size; ++i) {
    out += kHex[bytes[i] >> 4];
    out += kHex[bytes[i] & 0xf];
  }
  return out;
}

std::string sha256_hex(const void* data, std::size_t size) {
  Context context = start();
  check(EVP_DigestUpdate(context.get(), data, size), "EVP_DigestUpdate");
  return finish(context.get());
}

std::string sha256_file(const std::filesystem::path& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    throw CheckpointError("cannot open " + path.string() + " to hash it (" + std::strerror(errno) +
                          ")");
  }
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  Context context = start();
  std::vector<unsigned char> buffer(1 << 20);
  for (;;) {
    const ssize_t n = ::read(fd, buffer.data(), buffer.size());
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      throw CheckpointError("cannot read " + path.string() + " to hash it (" +
                            std::strerror(errno) + ")");
    }
    if (n == 0) break;
    check(EVP_DigestUpdate(context.get(), buffer.data(), static_cast<std::size_t>(n)),
          "EVP_DigestUpdate");
  }
  return finish(context.get());
}

std::array<std::uint8_t, 32> hmac_sha256(const std::string& key, const std::string& message) {
  std::array<std::uint8_t, 32> out{};
  std::size_t length = 0;
  if (!EVP_Q_mac(nullptr, "HMAC", nullptr, "SHA256", nullptr, key.data(), key.size(),
                 reinterpret_cast<const unsigned char*>(message.data()), message.size(),
                 out.data(), out.size(), &length) ||
      length != out.size()) {
    throw Error("HMAC-SHA256 failed (OpenSSL)");
  }
  return out;
}

std::string hmac_sha256_hex(const std::string& key, const std::string& message) {
  const auto mac = hmac_sha256(key, message);
  return to_hex(mac.data(), mac.size());
}

void fill_random(std::uint8_t* out, std::size_t n) {
  if (RAND_bytes(out, static_cast<int>(n)) != 1) {
    throw Error("the system's random number generator failed (OpenSSL RAND_bytes)");
  }
}

bool equal_secret(const std::uint8_t* a, const std::uint8_t* b, std::size_t n) {
  return CRYPTO_memcmp(a, b, n) == 0;
}

} // namespace flotilla::base
