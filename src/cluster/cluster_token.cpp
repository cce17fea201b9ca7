#include "flotilla/cluster/cluster_token.h"

#include <sys/stat.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>
#include <utility>

#include "flotilla/error.h"

namespace flotilla::cluster {

namespace {

constexpr std::size_t kMaxTokenBytes = 4096;

std::string read_token_file(const std::filesystem::path& path, const std::string& source) {
  struct stat info {};
  if (::stat(path.c_str(), &info) != 0) {
    throw ConfigError("cannot read the cluster token file " + path.string() + " (" + source +
                      "): " + std::strerror(errno) + "; check the path");
  }
  if (!S_ISREG(info.st_mode)) {
    throw ConfigError("the cluster token file " + path.string() + " (" + source +
                      ") is not a regular file; point it at the file that holds the token");
  }
  // Like ssh with a private key: a secret others can read is no secret.
  if (info.st_mode & (S_IRGRP | S_IWGRP | S_IROTH | S_IWOTH)) {
    throw ConfigError("the cluster token file " + path.string() + " (" + source +
                      ") can be read or written by other users (mode " +
                      std::to_string((info.st_mode >> 6) & 7) +
                      std::to_string((info.st_mode >> 3) & 7) + std::to_string(info.st_mode & 7) +
                      "); run chmod 600 on it");
  }
  if (static_cast<std::size_t>(info.st_size) > kMaxTokenBytes) {
    throw ConfigError("the cluster token file " + path.string() + " (" + source + ") holds " +
                      std::to_string(info.st_size) + " bytes, more than the " +
                      std::to_string(kMaxTokenBytes) + " a token may have");
  }
  std::ifstream in(path, std::ios::binary);
  std::stringstream content;
  content << in.rdbuf();
  std::string token = content.str();
  while (!token.empty() && (token.back() == '\n' || token.back() == '\r')) token.pop_back();
  if (!in || token.empty()) {
    throw ConfigError("the cluster token file " + path.string() + " (" + source +
                      ") is empty or unreadable; write a long random secret into it, e.g. "
                      "openssl rand -hex 32");
  }
  return token;
}

} // namespace

std::optional<std::string> cluster_token(const Environment& env,
                                         const std::optional<std::filesystem::path>& file) {
  const auto variable = env.get("FLOTILLA_CLUSTER_TOKEN");
  // Set but empty reads as "no token" everywhere else, so the job would run unauthenticated
  // while its author believes it holds a secret (a template's ${TOKEN} that expanded to nothing).
  const std::pair<const char*, const char*> sources[] = {
      {"FLOTILLA_CLUSTER_TOKEN", ""}, {"FLOTILLA_CLUSTER_TOKEN_FILE", " into a file it names"}};
  for (const auto& [name, where] : sources) {
    if (env.is_set(name) && !env.get(name)) {
      throw ConfigError(std::string(name) +
                        " is set but empty, which would mean no authentication at all; set a "
                        "long random secret (e.g. openssl rand -hex 32" +
                        where + "), or unset it to run without a token");
    }
  }
  std::optional<std::filesystem::path> path = file;
  std::string source = "the file given to cluster::cluster_token";
  if (!path) {
    if (const auto from_env = env.get("FLOTILLA_CLUSTER_TOKEN_FILE")) {
      path = *from_env;
      source = "FLOTILLA_CLUSTER_TOKEN_FILE";
    }
  }
  if (path && variable) {
    throw ConfigError("both FLOTILLA_CLUSTER_TOKEN and a token file (" + source +
                      ") are set; keep one of them");
  }
  if (path) return read_token_file(*path, source);
  if (variable && variable->size() > kMaxTokenBytes) {
    throw ConfigError("FLOTILLA_CLUSTER_TOKEN holds " + std::to_string(variable->size()) +
                      " bytes, more than the " + std::to_string(kMaxTokenBytes) +
                      " a token may have");
  }
  return variable;
}

} // namespace flotilla::cluster
