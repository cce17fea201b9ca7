// The cluster token: a shared secret every task of one cluster holds, so that the chief admits
// only processes that can prove it (HMAC-SHA256 challenge-response at the rendezvous) and a
// task can tell the real chief from an impostor. It comes from FLOTILLA_CLUSTER_TOKEN or from a
// file (FLOTILLA_CLUSTER_TOKEN_FILE, or --cluster-token-file), never from argv or TF_CONFIG,
// and it is never logged.
#pragma once

#include <filesystem>
#include <optional>
#include <string>

#include "flotilla/cluster/environment.h"

namespace flotilla::cluster {

// The token: `file` when given, else FLOTILLA_CLUSTER_TOKEN_FILE's file, else
// FLOTILLA_CLUSTER_TOKEN; nullopt when none is set. A file's content is used without its
// trailing newline. ConfigError for an unreadable or empty file, a file other users may read,
// or both the variable and a file.
std::optional<std::string> cluster_token(const Environment& env,
                                         const std::optional<std::filesystem::path>& file = {});

} // namespace flotilla::cluster
