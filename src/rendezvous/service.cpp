#include "flotilla/rendezvous/service.h"

#include "flotilla/error.h"
#include "flotilla/rendezvous/config.h"
#include "flotilla/rendezvous/server.h"

namespace flotilla::collective {

struct RendezvousService::Impl {
  detail::RendezvousConfig config;
  std::unique_ptr<detail::RendezvousServer> server;
};

RendezvousService::RendezvousService(const Options& options) : impl_(std::make_unique<Impl>()) {
  if (options.workers < 1) {
    throw ConfigError("a rendezvous needs at least one worker; saw " +
                      std::to_string(options.workers));
  }
  if (options.cluster_token && options.cluster_token->empty()) {
    throw ConfigError("the cluster token is empty; set a long random secret (e.g. openssl rand "
                      "-hex 32) or none");
  }
  detail::check_authenticated(!detail::loopback_host(options.listen.host), options.cluster_token,
                              options.insecure,
                              "the rendezvous listening at " + options.listen.to_string());
  auto& config = impl_->config;
  config.rank = 0;
  config.world_size = options.workers;
  config.chief = options.listen;
  config.token = options.cluster_token;
  config.heartbeat_timeout = options.heartbeat_timeout;
  config.elastic = options.elastic;
  config.external = true;
  for (int r = 0; r < options.workers; ++r) config.names.push_back("slot " + std::to_string(r));
  impl_->server = std::make_unique<detail::RendezvousServer>(config);
}

RendezvousService::~RendezvousService() = default;

int RendezvousService::port() const {
  return impl_->server->port();
}

std::string RendezvousService::address() const {
  return cluster::Address{impl_->config.chief.host, port()}.to_string();
}

} // namespace flotilla::collective
