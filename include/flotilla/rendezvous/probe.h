// Can this member reach that one? After a collective failed and no member left (every
// member still reaches the rendezvous), each member asks every other directly, and reports the
// ones that do not answer (kUnreachablePrefix); the rendezvous expels the smaller side of the
// partition (Membership::partitioned).
//
// UDP datagrams, each proven with the cluster token (HMAC-SHA256 over the message and a fresh
// nonce): no connection for a stranger to hold open, no answer to a datagram without the proof,
// at most 200 answers a second, and an answer counts only with the proof and the nonce asked.
// Without a token the proof is made with the empty key (a group without a token authenticates
// nothing else either).
#pragma once

#include <atomic>
#include <chrono>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace flotilla::collective::detail {

class ProbeResponder {
 public:
  // Answers on `host` (the address this member's collectives bind to; "" = this host's name), on
  // a port of its own. Error when it cannot bind.
  ProbeResponder(const std::string& host, std::optional<std::string> token);
  ~ProbeResponder();
  ProbeResponder(const ProbeResponder&) = delete;
  ProbeResponder& operator=(const ProbeResponder&) = delete;

  // "198.18.0.3:41234" or "[::1]:41234": where the others probe it.
  const std::string& address() const { return address_; }

 private:
  void serve();

  int fd_ = -1;
  std::string address_;
  std::optional<std::string> token_;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

// The ranks of `peers` (rank, the address its ProbeResponder published) that did not answer
// within `wait`, each asked three times; an address that does not parse or resolve counts as
// not answering.
std::vector<int> unreachable(const std::vector<std::pair<int, std::string>>& peers,
                             const std::optional<std::string>& token,
                             std::chrono::milliseconds wait);

} // namespace flotilla::collective::detail
