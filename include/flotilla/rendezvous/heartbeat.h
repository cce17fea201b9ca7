// A rank's heartbeat to the chief (see config.h), on a connection and a thread of
// its own, so it beats while the rank is blocked in a collective.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <string>

#include "flotilla/rendezvous/config.h"

namespace flotilla::collective::detail {

struct Pong;

// Elastic mode: a peer's failure is membership news, not the end, and so is a lost rendezvous.
struct ElasticHooks {
  // Every answer.
  std::function<void(const Pong&)> on_pong;
  // The rendezvous stopped answering or its connection broke: training goes on; nothing waits
  // to be admitted until it is back.
  std::function<void()> on_outage;
  // In an outage, an attempt to join again found the rendezvous unreachable (no answer in time,
  // or no connection), as opposed to one that answered.
  std::function<void()> on_unreachable;
  // Before the heartbeat joins again: the store connection joins first (the server takes a
  // heartbeat only from a process that holds its slot). Throws what Connection::join throws.
  std::function<void(std::chrono::steady_clock::time_point deadline)> rejoin_store;
};

// Calls on_failure once, from its thread, with a sentence naming the failed rank(s) or the
// chief; says goodbye on destruction, so a rank that leaves normally is not reported. With
// `elastic` hooks every answer goes to on_pong and the heartbeat goes on; a rendezvous that dies
// or freezes is waited for (and joined again once it is back: config.standing names this
// process's generation to it) until config.timeout; on_failure is called only then, or when the
// server expels this rank.
class Heartbeat {
 public:
  Heartbeat(const RendezvousConfig& config, std::function<void(const std::string&)> on_failure,
            ElasticHooks elastic = {});
  ~Heartbeat();
  Heartbeat(const Heartbeat&) = delete;
  Heartbeat& operator=(const Heartbeat&) = delete;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

} // namespace flotilla::collective::detail
