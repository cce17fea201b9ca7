#include "checkpoint/manifest.h"

#include <type_traits>

#include "flotilla/error.h"

namespace flotilla::checkpoint::detail {
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

bool plain_name(const std::string& name) {
  return !name.empty() && name != "." && name != ".." && name.find('/') == std::string::npos &&
         name.find('\0') == std::string::npos;
}

template <class T> T field(const json& manifest, const char* name, const fs::path& file) {
  const auto it = manifest.find(name);
  bool ok = it != manifest.end();
  if (ok) {
    if constexpr (std::is_same_v<T, std::string>) {
      ok = it->is_string();
    } else {
      ok = it->is_number_integer();
    }
  }
  if (!ok) {
    throw CheckpointError(file.string() + ": field \"" + name + "\" is missing or not " +
                          (std::is_same_v<T, std::string> ? "a string" : "an integer") +
                          "; the manifest is damaged. " + restore_advice(file.parent_path()));
  }
  return it->get<T>();
}

} // namespace

std::string restore_advice(const fs::path& checkpoint_dir) {
  return "Restore from an older checkpoint (restore_latest falls back to one) or delete " +
         checkpoint_dir.string();
}

Manifest parse_manifest(std::string_view text, const fs::path& path, const ManifestRules& rules) {
  const fs::path checkpoint_dir = path.parent_path();
  json manifest;
  try {
    manifest = json::parse(text);
  } catch (const json::exception& e) { // parse_error, or out_of_range for a number like 1e999
    throw CheckpointError(path.string() + ": not valid JSON (" + e.what() +
                          "); the file is truncated or damaged. " + restore_advice(checkpoint_dir));
  }
  if (!manifest.is_object()) {
    throw CheckpointError(path.string() + ": not a JSON object; the manifest is damaged. " +
                          restore_advice(checkpoint_dir));
  }
  const auto format = manifest.find("format");
  if (format == manifest.end() || !format->is_string() || *format != rules.format) {
    throw CheckpointError(path.string() + ": format is " +
                          (format == manifest.end() ? std::string("missing") : format->dump()) +
                          ", expected \"" + rules.format + "\"; this is not a flotilla checkpoint");
  }
  Manifest out;
  out.format_version = field<std::int64_t>(manifest, "format_version", path);
  if (out.format_version < 1 || out.format_version > rules.max_version) {
    throw CheckpointError(path.string() + ": format_version " + std::to_string(out.format_version) +
                          ", but this build of flotilla reads version " +
                          std::to_string(rules.max_version) +
                          (out.format_version > rules.max_version
                               ? "; it was written by a newer flotilla: upgrade to read it"
                               : "; the manifest is damaged"));
  }
  out.number = field<std::int64_t>(manifest, "number", path);
  out.epoch = field<std::int64_t>(manifest, "epoch", path);
  out.step = field<std::int64_t>(manifest, "step", path);
  out.policy = field<std::string>(manifest, "policy", path);
  if (manifest.contains("generation")) {
    out.generation = field<std::int64_t>(manifest, "generation", path);
    if (out.generation < 0) {
      throw CheckpointError(path.string() + ": generation " + std::to_string(out.generation) +
                            " is negative; the manifest is damaged. " +
                            restore_advice(checkpoint_dir));
    }
  }
  if (manifest.contains("state")) out.state = manifest["state"];

  const auto files = manifest.find("files");
  if (files == manifest.end() || !files->is_object()) {
    throw CheckpointError(path.string() +
                          ": \"files\" is missing or not an object; the manifest is damaged. " +
                          restore_advice(checkpoint_dir));
  }
  for (const auto& required : rules.required_files) {
    if (!files->contains(required)) {
      throw CheckpointError(path.string() + ": does not list " + required +
                            "; the manifest is damaged. " + restore_advice(checkpoint_dir));
    }
  }
  for (const auto& [name, entry] : files->items()) {
    const bool entry_ok = plain_name(name) && entry.is_object() && entry.contains("sha256") &&
                          entry["sha256"].is_string() && entry.contains("bytes") &&
                          entry["bytes"].is_number_unsigned();
    if (!entry_ok) {
      throw CheckpointError(path.string() + ": the entry for \"" + name +
                            "\" is not {\"sha256\": ..., \"bytes\": ...}; the manifest is "
                            "damaged. " +
                            restore_advice(checkpoint_dir));
    }
    out.files.push_back(
        {name, entry["sha256"].get<std::string>(), entry["bytes"].get<std::uint64_t>()});
  }
  return out;
}

} // namespace flotilla::checkpoint::detail
