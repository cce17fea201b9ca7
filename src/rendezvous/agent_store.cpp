#include "flotilla/rendezvous/agent_store.h"

#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <string>
#include <vector>

#include "flotilla/error.h"

namespace flotilla::collective::detail {

void meet_through_agent_store(const cluster::ClusterSpec& spec, std::chrono::milliseconds timeout,
                              RendezvousConfig& config, std::unique_ptr<RendezvousServer>& server) {
  const std::string where = "torchrun's agent store at " + spec.rendezvous.to_string() +
                            " (TORCHELASTIC_USE_AGENT_STORE)";
  c10d::TCPStoreOptions store_options;
  store_options.port = static_cast<std::uint16_t>(spec.rendezvous.port);
  store_options.isServer = false;
  store_options.waitWorkers = false;
  store_options.timeout = timeout;
  c10::intrusive_ptr<c10d::TCPStore> agent;
  try {
    agent = c10::make_intrusive<c10d::TCPStore>(spec.rendezvous.host, store_options);
  } catch (const std::exception& e) {
    throw CommError("could not reach " + where + ": " + e.what());
  }
  const std::string& key = spec.agent_store_key;
  if (spec.rank == 0) {
    config.chief.port = 0; // a port of its own: the agent holds MASTER_PORT
    server = std::make_unique<RendezvousServer>(config);
    config.chief.port = server->port();
    const std::string address = config.chief.to_string();
    agent->set(key, std::vector<std::uint8_t>(address.begin(), address.end()));
    return;
  }
  try {
    agent->wait({key}, timeout);
  } catch (const std::exception& e) {
    throw TimeoutError("the chief (rank 0) did not publish its rendezvous in " + where +
                       " within the timeout; is rank 0 running? (" + e.what() + ")");
  }
  const std::vector<std::uint8_t> bytes = agent->get(key);
  config.chief = cluster::parse_address(std::string(bytes.begin(), bytes.end()),
                                        "the chief's rendezvous in " + where);
}

} // namespace flotilla::collective::detail
