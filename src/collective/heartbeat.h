// Private: a rank's heartbeat to the chief (see rendezvous.h), on a connection and a thread of
// its own, so it beats while the rank is blocked in a collective.
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "collective/rendezvous.h"

namespace flotilla::collective::detail {

// Calls on_failure once, from its thread, with a sentence naming the failed rank(s) or the
// chief; says goodbye on destruction, so a rank that leaves normally is not reported. In elastic
// mode a peer's failure is membership news, not the end: every answer goes to on_pong and the
// heartbeat goes on; on_failure is called only when the server is lost or expels this rank.
struct Pong;
class Heartbeat {
 public:
  Heartbeat(const RendezvousConfig& config, std::function<void(const std::string&)> on_failure,
            std::function<void(const Pong&)> on_pong = {});
  ~Heartbeat();
  Heartbeat(const Heartbeat&) = delete;
  Heartbeat& operator=(const Heartbeat&) = delete;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

} // namespace flotilla::collective::detail
