#include "flotilla/cluster/resolvers.h"

#include <cctype>

#include "flotilla/error.h"

namespace flotilla::cluster {
namespace {

long parse_int(const Environment& env, const std::string& name, long min, const std::string& fix) {
  const auto value = env.get(name);
  if (!value) throw ConfigError(name + " is not set; " + fix);
  long out = 0;
  bool ok = !value->empty() && value->size() < 10;
  for (char c : *value) ok = ok && std::isdigit(static_cast<unsigned char>(c));
  if (ok) out = std::stol(*value);
  if (!ok || out < min) {
    throw ConfigError(name + " must be an integer >= " + std::to_string(min) + "; saw \"" + *value +
                      "\"; " + fix);
  }
  return out;
}

} // namespace

ClusterSpec from_torchrun_env(const Environment& env) {
  const std::string fix =
      "torchrun-style launch sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT";
  ClusterSpec spec;
  spec.source = "torchrun environment";
  spec.world_size = static_cast<int>(parse_int(env, "WORLD_SIZE", 1, fix));
  spec.rank = static_cast<int>(parse_int(env, "RANK", 0, fix));
  if (spec.rank >= spec.world_size) {
    throw ConfigError("RANK " + std::to_string(spec.rank) + " is out of range for WORLD_SIZE " +
                      std::to_string(spec.world_size) + "; use 0 to " +
                      std::to_string(spec.world_size - 1));
  }
  const auto host = env.get("MASTER_ADDR");
  if (!host) throw ConfigError("MASTER_ADDR is not set; " + fix);
  const auto port = env.get("MASTER_PORT");
  if (!port) throw ConfigError("MASTER_PORT is not set; " + fix);
  const bool v6 = host->find(':') != std::string::npos && host->front() != '[';
  spec.rendezvous =
      parse_address((v6 ? "[" + *host + "]" : *host) + ":" + *port, "MASTER_ADDR/MASTER_PORT");
  spec.task = {spec.rank == 0 ? TaskType::kChief : TaskType::kWorker, spec.rank};
  // A loopback master means every rank is on this machine; otherwise let Gloo pick the
  // address this host's name resolves to.
  if (spec.rendezvous.host == "127.0.0.1" || spec.rendezvous.host == "localhost" ||
      spec.rendezvous.host == "::1") {
    spec.local_host = spec.rendezvous.host;
  }
  return spec;
}

ClusterSpec single_worker() {
  ClusterSpec spec;
  spec.source = "single worker";
  spec.task = {TaskType::kWorker, 0};
  spec.rendezvous = Address{"127.0.0.1", 0}; // nothing listens: a group of one needs no network
  spec.local_host = "127.0.0.1";
  return spec;
}

ClusterSpec resolve_cluster(const Environment& env) {
  if (const auto tf_config = env.get("TF_CONFIG")) return parse_tf_config(*tf_config);
  if (env.get("RANK") || env.get("WORLD_SIZE")) return from_torchrun_env(env);
  return single_worker();
}

int local_world_size(const Environment& env) {
  if (!env.get("LOCAL_WORLD_SIZE")) return 1;
  return static_cast<int>(
      parse_int(env, "LOCAL_WORLD_SIZE", 1, "it is the number of workers on this machine"));
}

} // namespace flotilla::cluster
