// The chief's side of the rendezvous (see config.h): one thread, one poll loop,
// non-blocking sockets. It takes each connection through the join handshake, serves the store's
// requests from a KvStore, and keeps the heartbeats' books: which rank pinged when, which left
// with a goodbye, which failed and why.
//
// Elastic mode (config.elastic, hosted outside the workers): the server is the one arbiter of
// membership (its rules: membership.h; the server applies them to its store and sockets). Slots are the ranks of the full cluster; the members of a generation are some of
// them, in slot order, and their ranks in that generation are dense (so the lowest surviving
// slot is rank 0, the chief). Generation 0 forms when every slot has joined. When a member's
// process dies, leaves, or falls silent for heartbeat_timeout, its slot is freed for a new
// process and the next generation forms at once from the rest: an arbiter that decides alone
// cannot split the group in two. A process that claims a free slot waits until the members
// admit it at a step boundary (kAdvance). Each generation's backends meet under the store
// prefix "flotilla/g<N>/"; the generations are recorded under kGenerationKey.
#pragma once

#include <memory>
#include <string>

#include "flotilla/rendezvous/config.h"

namespace flotilla::collective::detail {

// kGenerationKey + N: "slot,slot,...\nwhy it formed", and a third line "afresh" when the
// generation starts the training over (generation 0, or every slot joined again after the whole
// group was lost); kLatestKey: the newest N. kFinishedKey: set by a member whose fit ran to its
// end, so that workers claiming a slot once no member is left learn there is nothing to do
// instead of starting the training afresh.
extern const std::string kGenerationKey;
extern const std::string kLatestKey;
extern const std::string kFinishedKey;

// Listens on config.chief from construction to destruction.
class RendezvousServer {
 public:
  explicit RendezvousServer(const RendezvousConfig& config);
  ~RendezvousServer();
  RendezvousServer(const RendezvousServer&) = delete;
  RendezvousServer& operator=(const RendezvousServer&) = delete;
  // The port it listens on (config.chief.port, or the kernel's choice for port 0).
  int port() const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

} // namespace flotilla::collective::detail
