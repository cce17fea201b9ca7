// Private: the chief's side of the rendezvous (see rendezvous.h): one thread, one poll loop,
// non-blocking sockets. It takes each connection through the join handshake, serves the store's
// requests from a KvStore, and keeps the heartbeats' books: which rank pinged when, which left
// with a goodbye, which failed and why.
#pragma once

#include <memory>

#include "collective/rendezvous.h"

namespace flotilla::collective::detail {

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
