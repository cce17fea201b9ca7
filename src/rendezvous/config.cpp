#include "flotilla/rendezvous/config.h"

#include <arpa/inet.h>
#include <netinet/in.h>

#include "flotilla/error.h"
#include "flotilla/log.h"
#include "rendezvous/etcd.h"
#include "rendezvous/wire.h"

namespace flotilla::collective::detail {

std::string RendezvousConfig::name(int r) const {
  if (r >= 0 && static_cast<std::size_t>(r) < names.size()) return names[r];
  return "rank " + std::to_string(r);
}

std::string RendezvousConfig::server_name() const {
  if (!external) return name(0) + ", which hosts the rendezvous,";
  return "the rendezvous at " + (locate ? locate_name : chief.to_string());
}

std::array<std::uint8_t, 16> new_session() {
  return random_bytes<16>();
}

std::string ms_text(std::chrono::milliseconds d) {
  const auto ms = d.count();
  return ms % 1000 == 0 ? std::to_string(ms / 1000) + " s" : std::to_string(ms) + " ms";
}

std::vector<std::string> rank_names(const cluster::ClusterSpec& spec) {
  std::vector<std::string> names;
  const auto addresses = spec.training_addresses();
  if (static_cast<int>(addresses.size()) != spec.world_size) return names;
  for (int r = 0; r < spec.world_size; ++r) {
    const bool has_chief = !spec.chief.empty();
    const std::string task = has_chief && r == 0
                                 ? std::string("chief")
                                 : "worker " + std::to_string(has_chief ? r - 1 : r);
    names.push_back(task + " at " + addresses[static_cast<std::size_t>(r)].to_string() + " (rank " +
                    std::to_string(r) + ")");
  }
  return names;
}

bool loopback_host(const std::string& host) {
  if (host == "localhost" || host == "::1") return true;
  in_addr v4{};
  return ::inet_pton(AF_INET, host.c_str(), &v4) == 1 && (ntohl(v4.s_addr) >> 24) == 127;
}

void check_authenticated(bool reachable, const std::optional<std::string>& token, bool insecure,
                         const std::string& what) {
  if (token || !reachable) return;
  if (!insecure) {
    throw ConfigError(
        what + " without a cluster token: any process that reaches it could join the job, "
               "read and write its store and feed the workers. Set the same long random secret "
               "on every task (FLOTILLA_CLUSTER_TOKEN or FLOTILLA_CLUSTER_TOKEN_FILE; e.g. "
               "openssl rand -hex 32), or allow this explicitly with "
               "CommunicationOptions::insecure");
  }
  Logger().warn("INSECURE: " + what +
                " without a cluster token (CommunicationOptions::insecure): any process that "
                "reaches it can join this job");
}

RendezvousConfig rendezvous_config(const cluster::ClusterSpec& spec,
                                   const RendezvousOptions& options) {
  if (options.heartbeat_interval <= std::chrono::milliseconds(0) ||
      options.heartbeat_timeout <= options.heartbeat_interval) {
    throw ConfigError("the heartbeat needs 0 < CommunicationOptions::heartbeat_interval < "
                      "CommunicationOptions::heartbeat_timeout; saw " +
                      ms_text(options.heartbeat_interval) + " and " +
                      ms_text(options.heartbeat_timeout));
  }
  if (options.cluster_token && options.cluster_token->empty()) {
    throw ConfigError("CommunicationOptions::cluster_token is empty; set a long random secret "
                      "(e.g. openssl rand -hex 32) or leave it unset");
  }
  // Another host takes part, or reaches the rendezvous: the network is not only this machine's.
  bool reachable = !loopback_host(spec.rendezvous.host);
  for (const auto& address : spec.training_addresses()) {
    reachable = reachable || !loopback_host(address.host);
  }
  if (spec.world_size > 1) {
    check_authenticated(reachable, options.cluster_token, options.insecure,
                        "this job's rendezvous at " + spec.rendezvous.to_string() +
                            " is reachable from other hosts");
  }
  RendezvousConfig config;
  config.rank = spec.rank;
  config.world_size = spec.world_size;
  config.chief = spec.rendezvous;
  config.token = options.cluster_token;
  config.timeout = options.timeout;
  config.heartbeat_interval = options.heartbeat_interval;
  config.heartbeat_timeout = options.heartbeat_timeout;
  config.names = rank_names(spec);
  config.session = new_session();
  config.external = spec.external_rendezvous;
  if (!spec.etcd.endpoints.empty()) {
    // The replica etcd names now (etcd_rendezvous.cpp); asked again after each lost connection.
    auto etcd = std::make_shared<EtcdClient>(spec.etcd, std::chrono::seconds(2));
    config.locate = [etcd, key = spec.etcd.key()]() -> std::optional<cluster::Address> {
      // A ConfigError from etcd (it refused this client's certificate or user) goes up:
      // asking again cannot help.
      std::optional<std::string> value;
      try {
        value = etcd->get(key);
      } catch (const CommError&) {
        return std::nullopt; // no endpoint answered: none named now; asked again
      }
      try {
        if (value) return cluster::parse_address(*value, "etcd key " + key);
      } catch (const ConfigError&) {
        // A value that is no address: none named now; asked again.
      }
      return std::nullopt;
    };
    config.locate_name = spec.etcd.url();
  }
  return config;
}

} // namespace flotilla::collective::detail
