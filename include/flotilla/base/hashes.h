// Hashes and secrets, from OpenSSL. SHA-256 as lowercase hex, the form `sha256sum` and Python's
// hashlib print: a checkpoint's manifest records one per file so a reader can tell a damaged file
// from a good one before loading it. HMAC-SHA256: the rendezvous's proof that a task holds the
// cluster token. Random bytes (nonces, session and segment names) and a comparison of secrets in
// constant time.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <string>

namespace flotilla::base {

// The digest of a whole file, read in 1 MiB pieces (any size, constant memory). CheckpointError
// naming the file when it cannot be opened or read.
std::string sha256_file(const std::filesystem::path& path);

// The digest of `size` bytes in memory.
std::string sha256_hex(const void* data, std::size_t size);

// HMAC-SHA256 of `message` under `key`.
std::array<std::uint8_t, 32> hmac_sha256(const std::string& key, const std::string& message);
// The same as lowercase hex.
std::string hmac_sha256_hex(const std::string& key, const std::string& message);

// `size` bytes as lowercase hex, two digits a byte.
std::string to_hex(const void* data, std::size_t size);
template <std::size_t N> std::string to_hex(const std::array<std::uint8_t, N>& bytes) {
  return to_hex(bytes.data(), N);
}

// N random bytes from the system's generator (OpenSSL); Error when it fails.
void fill_random(std::uint8_t* out, std::size_t n);
template <std::size_t N> std::array<std::uint8_t, N> random_bytes() {
  std::array<std::uint8_t, N> out{};
  fill_random(out.data(), N);
  return out;
}

// In constant time, so a comparison leaks no timing oracle.
bool equal_secret(const std::uint8_t* a, const std::uint8_t* b, std::size_t n);
template <std::size_t N>
bool equal_secret(const std::array<std::uint8_t, N>& a, const std::array<std::uint8_t, N>& b) {
  return equal_secret(a.data(), b.data(), N);
}

} // namespace flotilla::base
