// Hashes, from OpenSSL. SHA-256 as lowercase hex, the form `sha256sum` and Python's hashlib
// print: a checkpoint's manifest records one per file so a reader can tell a damaged file from
// a good one before loading it. HMAC-SHA256: the rendezvous's proof that a task holds the
// cluster token.
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

} // namespace flotilla::base
