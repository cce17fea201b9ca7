// SHA-256 (OpenSSL's EVP digest) as lowercase hex, the form `sha256sum` and Python's hashlib
// print: a checkpoint's manifest records one per file so a reader can tell a damaged file from
// a good one before loading it.
#pragma once

#include <cstddef>
#include <filesystem>
#include <string>

namespace flotilla::checkpoint {

// The digest of a whole file, read in 1 MiB pieces (any size, constant memory). CheckpointError
// naming the file when it cannot be opened or read.
std::string sha256_file(const std::filesystem::path& path);

// The digest of `size` bytes in memory.
std::string sha256_hex(const void* data, std::size_t size);

} // namespace flotilla::checkpoint
