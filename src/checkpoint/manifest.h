// Private: a checkpoint's manifest.json read from its bytes, without LibTorch, so that the
// checks on untrusted input can be fuzzed on their own (tests/fuzz). read_checkpoint compares
// the listed files' sizes and SHA-256 against the disk afterwards.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

namespace flotilla::checkpoint::detail {

struct ManifestEntry {
  std::string name; // a plain file name inside the checkpoint directory
  std::string sha256;
  std::uint64_t bytes = 0;
};

struct Manifest {
  std::int64_t format_version = 0;
  std::int64_t number = 0;
  std::int64_t epoch = 0;
  std::int64_t step = 0;
  std::string policy;
  std::int64_t generation = -1; // the fencing token; -1 when the manifest has none
  nlohmann::json state = nlohmann::json::object();
  std::vector<ManifestEntry> files;
};

// What the reader expects: the format's name, the newest version it reads, the files that must
// be listed.
struct ManifestRules {
  std::string format;
  std::int64_t max_version = 1;
  std::vector<std::string> required_files;
};

// Validates the manifest's shape; CheckpointError names `path`, the field and what is wrong.
Manifest parse_manifest(std::string_view text, const std::filesystem::path& path,
                        const ManifestRules& rules);

// The advice every damaged-checkpoint error ends with.
std::string restore_advice(const std::filesystem::path& checkpoint_dir);

} // namespace flotilla::checkpoint::detail
