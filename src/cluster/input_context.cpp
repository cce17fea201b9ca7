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

void check_shares(const std::vector<std::int64_t>& shares, int workers) {
  if (shares.empty()) return;
  if (static_cast<int>(shares.size()) != workers) {
    throw ConfigError("InputContext::shares has " + std::to_string(shares.size()) +
                      " weights for " + std::to_string(workers) +
                      " workers; give one per worker, in task order (the chief first)");
  }
  for (std::size_t w = 0; w < shares.size(); ++w) {
    if (shares[w] < 1 || shares[w] > kMaxShareWeight) {
      throw ConfigError("worker " + std::to_string(w) + "'s share " + std::to_string(shares[w]) +
                        " is not a whole number from 1 to " + std::to_string(kMaxShareWeight));
    }
  }
}

InputContext::Part InputContext::part_of(int worker) const {
  Part part;
  if (shares.empty()) {
    part.count = num_replicas_in_sync / num_input_pipelines; // replicas on each worker
    part.first = worker * part.count;
    part.parts = num_replicas_in_sync;
    return part;
  }
  check_shares(shares, num_input_pipelines);
  part.parts = part.first = 0;
  for (int w = 0; w < num_input_pipelines; ++w) {
    if (w < worker) part.first += shares[static_cast<std::size_t>(w)];
    part.parts += shares[static_cast<std::size_t>(w)];
  }
  part.count = shares[static_cast<std::size_t>(worker)];
  return part;
}

} // namespace flotilla::cluster
