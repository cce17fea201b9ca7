// Private: a rank's connection to the chief's rendezvous server (see config.h). A blocking
// socket, every wait bounded by a deadline; joining runs the handshake of wire.h, so a
// connection exists only once both sides have proved they hold the cluster token.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include "flotilla/rendezvous/config.h"
#include "rendezvous/wire.h"
#include "flotilla/error.h"

namespace flotilla::collective::detail {

// The connection broke (the server closed it, died, or reset it): an elastic member reconnects.
struct ConnectionLost : CommError {
  using CommError::CommError;
};

// Refused for now (the slot is still held by a process the server has not released, or the
// server closed the connection before its greeting): join() tries again until its deadline.
struct RefusedForNow : CommError {
  using CommError::CommError;
};

// How long a connection waits for the server's greeting before it connects again (see
// Connection::handshake).
inline constexpr std::chrono::seconds kGreetingWait{5};

class Connection {
 public:
  using Clock = std::chrono::steady_clock;

  Connection() = default;
  ~Connection();
  Connection(const Connection&) = delete;
  Connection& operator=(const Connection&) = delete;

  // Connects to the chief, retrying while nobody listens yet or it refuses for now (see
  // RefusedForNow), and joins as config.rank in `role`. TimeoutError when the chief cannot be
  // reached or joined by `deadline`; ConfigError when it refuses (wrong token, rank taken in a
  // fixed group, another cluster) or cannot prove it is the chief; CommError when what answers
  // is not a flotilla chief.
  static std::unique_ptr<Connection> join(const RendezvousConfig& config, Role role,
                                          Clock::time_point deadline);

  // TimeoutError past `deadline`; ConnectionLost when the connection is lost (or the deadline
  // cut the message, which leaves the stream unusable).
  void send(const std::string& frame, Clock::time_point deadline);
  // One message; `max` bounds its size before anything is allocated for it. A TimeoutError
  // keeps what arrived of the message: the next call returns it whole.
  std::string receive(Clock::time_point deadline, std::size_t max = kMaxFrameBytes);

  int fd() const { return fd_; }
  // "host:port", for messages.
  const std::string& chief() const { return chief_; }
  // "the chief at host:port", or "the rendezvous at host:port" for `flotilla rendezvous`.
  std::string server() const {
    return (external_ ? "the rendezvous at " : "the chief at ") + chief_;
  }

 private:
  // A connected socket, not joined yet; TimeoutError when nobody listens by `deadline`.
  static std::unique_ptr<Connection> connect(const RendezvousConfig& config,
                                             Clock::time_point deadline);
  bool wait_ready(short events, Clock::time_point deadline);
  // Reads into inbox_ until it holds `n` bytes.
  void fill(std::size_t n, Clock::time_point deadline);
  [[noreturn]] void throw_timeout(const std::string& what) const;
  [[noreturn]] void throw_lost(const std::string& why) const;
  void handshake(const RendezvousConfig& config, Role role, Clock::time_point deadline);

  int fd_ = -1;
  std::string chief_;
  bool external_ = false; // chief_ is `flotilla rendezvous`, not a training rank
  std::string inbox_;     // what arrived of the message being received
};

} // namespace flotilla::collective::detail
