// Meeting under torchrun. Its agent keeps its own c10d TCPStore on MASTER_ADDR:MASTER_PORT
// (TORCHELASTIC_USE_AGENT_STORE=True; ClusterSpec::agent_store_key), so the chief cannot host
// flotilla's rendezvous there. It hosts it on a port of its own on that host instead and
// publishes the address in the agent's store, where the other ranks read it. (The agent's store
// is used only for that: the rendezvous keeps its own protocol, token and heartbeats.)
#pragma once

#include <chrono>
#include <memory>

#include "flotilla/rendezvous/config.h"
#include "flotilla/rendezvous/server.h"
#include "flotilla/cluster/cluster_spec.h"

namespace flotilla::collective::detail {

// On the chief: starts `server` on a free port of the agent store's host and publishes it; on
// the others: waits (`timeout`) for that address. Either way `config.chief` is then the
// rendezvous's address. CommError when the agent's store cannot be reached, TimeoutError when
// the chief never publishes.
void meet_through_agent_store(const cluster::ClusterSpec& spec, std::chrono::milliseconds timeout,
                              RendezvousConfig& config, std::unique_ptr<RendezvousServer>& server);

} // namespace flotilla::collective::detail
