#include "flotilla/cluster/input_context.h"

#include <string>

#include "flotilla/error.h"

namespace flotilla::cluster {

std::int64_t InputContext::get_per_replica_batch_size(std::int64_t global_batch) const {
  if (global_batch < 1) {
    throw ConfigError("global batch must be at least 1; saw " + std::to_string(global_batch));
  }
  if (global_batch < num_replicas_in_sync || global_batch % num_replicas_in_sync != 0) {
    throw ConfigError("global batch " + std::to_string(global_batch) +
                      " does not split evenly across " + std::to_string(num_replicas_in_sync) +
                      " replicas; use a multiple of " + std::to_string(num_replicas_in_sync));
  }
  return global_batch / num_replicas_in_sync;
}

std::string InputContext::describe_shares() const {
  if (shares.empty()) return "equal";
  std::string out;
  for (const std::int64_t w : shares) out += (out.empty() ? "" : ",") + std::to_string(w);
  return out;
}

} // namespace flotilla::cluster
