#include "rendezvous/connection.h"

#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <thread>

#include "rendezvous/sockets.h"
#include "flotilla/error.h"
#include "flotilla/log.h"

namespace flotilla::collective::detail {

Connection::~Connection() {
  if (fd_ >= 0) ::close(fd_);
}

std::unique_ptr<Connection> Connection::join(const RendezvousConfig& config, Role role,
                                             Clock::time_point deadline) {
  bool told = false;
  for (;;) {
    auto conn = connect(config, deadline);
    try {
      conn->handshake(config, role, deadline);
      return conn;
    } catch (const RefusedForNow& e) {
      const auto pause = std::chrono::milliseconds(200);
      if (Clock::now() + pause >= deadline) {
        throw TimeoutError(config.name(config.rank) + " could not join " + conn->server() +
                           " within " + ms_text(config.timeout) + ": " + e.what() +
                           "; raise CommunicationOptions::timeout if that is expected");
      }
      if (!told) {
        Logger(config.rank, config.world_size)
            .warn(std::string(e.what()) + "; trying again until the timeout (" +
                  ms_text(config.timeout) + ")");
        told = true;
      }
      std::this_thread::sleep_for(pause);
    }
  }
}

std::unique_ptr<Connection> Connection::connect(const RendezvousConfig& config,
                                                Clock::time_point deadline) {
  auto conn = std::make_unique<Connection>();
  conn->chief_ = config.locate ? config.locate_name : config.chief.to_string();
  conn->external_ = config.external;
  std::string last_error;
  for (;;) {
    const auto where =
        config.locate ? config.locate() : std::optional<cluster::Address>(config.chief);
    if (!where) last_error = "no replica of it is named there now";
    AddrInfo info;
    if (where) {
      conn->chief_ = where->to_string();
      resolve(*where, info);
    }
    for (addrinfo* a = info.list; a && conn->fd_ < 0; a = a->ai_next) {
      const int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
      if (fd < 0) continue;
      if (connect_within(fd, a, deadline)) {
        conn->fd_ = fd;
      } else {
        last_error = std::strerror(errno);
        ::close(fd);
      }
    }
    if (conn->fd_ >= 0) break;
    if (Clock::now() >= deadline) {
      throw TimeoutError(
          config.name(config.rank) + " could not reach " +
          (config.external ? "the rendezvous at " : "the chief's rendezvous at ") + conn->chief_ +
          " within " + ms_text(config.timeout) + " (" + last_error + "); " +
          (config.external ? "start it (flotilla rendezvous), check FLOTILLA_RENDEZVOUS"
                           : "start the chief, check its address in TF_CONFIG") +
          " and that this host can reach it, or raise CommunicationOptions::timeout");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  set_nodelay(conn->fd_);
  if (config.standing) {
    // Elastic: a request the server's host does not acknowledge within the heartbeat timeout
    // breaks the connection (its host is gone, or the network), so the member joins a
    // rendezvous restarted elsewhere. A stopped server process does not: its kernel still
    // acknowledges, and the member waits for its answer.
    const unsigned ms = static_cast<unsigned>(config.heartbeat_timeout.count());
    ::setsockopt(conn->fd_, IPPROTO_TCP, TCP_USER_TIMEOUT, &ms, sizeof ms);
  }
  return conn;
}

void Connection::send(const std::string& frame, Clock::time_point deadline) {
  std::size_t sent = 0;
  while (sent < frame.size()) {
    if (!wait_ready(POLLOUT, deadline)) {
      // Part of the message is out: the server would read the next one from its middle.
      if (sent > 0) throw_lost("a message was cut off at the deadline");
      throw_timeout("sending to");
    }
    const ssize_t n = ::send(fd_, frame.data() + sent, frame.size() - sent, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) throw_lost(std::strerror(errno));
    sent += static_cast<std::size_t>(n);
  }
}

std::string Connection::receive(Clock::time_point deadline, std::size_t max) {
  // A deadline can fall inside a message: what was read of it stays in inbox_ and the next call
  // goes on from there, so the stream never loses its place.
  fill(4, deadline);
  const std::uint32_t n = read_le32(inbox_.data());
  if (n > max) {
    throw CommError(server() + " sent a message of " + std::to_string(n) +
                    " bytes, over the limit of " + std::to_string(max) +
                    "; is that address really a flotilla chief?");
  }
  fill(4 + std::size_t{n}, deadline);
  std::string body = inbox_.substr(4);
  inbox_.clear();
  return body;
}

bool Connection::wait_ready(short events, Clock::time_point deadline) {
  for (;;) {
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    pollfd p{fd_, events, 0};
    // Past the deadline, one look without waiting: what already arrived is read (after this
    // process was stopped or starved, the server is not to blame).
    const int rc = ::poll(&p, 1, static_cast<int>(std::clamp<std::int64_t>(left, 0, 1000)));
    if (rc > 0) return true;
    if (rc < 0 && errno != EINTR) throw_lost(std::strerror(errno));
    if (left <= 0 && rc == 0) return false;
  }
}

void Connection::fill(std::size_t n, Clock::time_point deadline) {
  while (inbox_.size() < n) {
    if (!wait_ready(POLLIN, deadline)) throw_timeout("waiting for");
    const std::size_t had = inbox_.size();
    inbox_.resize(n); // only this message's bytes: the next one stays in the socket
    const ssize_t r = ::recv(fd_, inbox_.data() + had, n - had, 0);
    const int error = errno;
    inbox_.resize(had + static_cast<std::size_t>(std::max<ssize_t>(r, 0)));
    if (r < 0 && (error == EINTR || error == EAGAIN)) continue;
    if (r == 0) throw_lost("the connection was closed");
    if (r < 0) throw_lost(std::strerror(error));
  }
}

void Connection::throw_timeout(const std::string& what) const {
  throw TimeoutError("Timed out " + what + " the chief's rendezvous at " + chief_);
}

void Connection::throw_lost(const std::string& why) const {
  if (external_) {
    throw ConnectionLost("lost the connection to the rendezvous at " + chief_ + " (" + why +
                         "): it exited, was killed, or is unreachable");
  }
  throw ConnectionLost("lost the connection to the chief's rendezvous at " + chief_ + " (" + why +
                       "): the chief exited, was killed, or is unreachable");
}

void Connection::handshake(const RendezvousConfig& config, Role role, Clock::time_point deadline) {
  // The server reached, the handshake gets a heartbeat timeout however short the caller's
  // deadline (a rejoin attempt's is about a heartbeat interval): once the server has the join
  // request, the process counts as back, and hanging up before its answer reads there as the
  // process dying (an elastic member rejoining a new rendezvous replica was expelled so, on a
  // loaded machine).
  deadline = std::max(deadline, Clock::now() + config.heartbeat_timeout);
  Hello hello;
  try {
    // The server greets a connection as soon as it accepts it. One not greeted within
    // kGreetingWait was most likely lost in a full listen backlog (a thousand workers connecting
    // at once): the kernel completed it on this side and dropped it on the server's, which never
    // sees it, and waiting here would last the whole timeout. It is connected again instead.
    hello = Hello::parse(receive(std::min(deadline, Clock::now() + kGreetingWait),
                                 kMaxHandshakeFrame));
  } catch (const ConnectionLost&) {
    throw RefusedForNow(server() + " closed the connection before its greeting (it holds as many "
                                   "connections as it takes, or it is stopping)");
  } catch (const TimeoutError&) {
    if (Clock::now() >= deadline) throw;
    throw RefusedForNow(server() + " did not greet the connection within " +
                        ms_text(kGreetingWait) + " (lost in a full backlog, or the server is "
                        "stalled)");
  } catch (const WireError&) {
    throw CommError("the process at " + chief_ +
                    " does not speak flotilla's rendezvous protocol; check the chief's "
                    "address and port in TF_CONFIG");
  }
  if (hello.auth_required && !config.token) {
    throw ConfigError(server() +
                      " requires a cluster token and this task has none; set "
                      "FLOTILLA_CLUSTER_TOKEN (or FLOTILLA_CLUSTER_TOKEN_FILE) as on the chief");
  }
  if (!hello.auth_required && config.token) {
    throw ConfigError("this task has a cluster token but the process at " + chief_ +
                      " does not ask for one, so it cannot prove it is the chief; give every "
                      "task the same FLOTILLA_CLUSTER_TOKEN");
  }
  JoinRequest join;
  join.role = role;
  join.flags = config.elastic ? kJoinElastic : 0;
  join.rank = config.rank;
  join.world = config.world_size;
  join.session = config.session;
  join.client_nonce = random_bytes<32>();
  if (config.standing) {
    std::lock_guard<std::mutex> lock(config.standing->mutex);
    if (config.standing->member) {
      join.flags |= kJoinMember;
      join.generation = config.standing->generation;
      join.members = config.standing->slots;
    }
  }
  if (config.token) join.mac = join_mac(*config.token, hello.nonce, join);
  send(join.frame(), deadline);
  Welcome welcome;
  try {
    welcome = Welcome::parse(receive(deadline));
  } catch (const WireError& e) {
    throw CommError(server() + " sent a malformed answer (" + e.what() + ")");
  }
  if (!welcome.accepted && welcome.retry) {
    throw RefusedForNow(server() + " refused " + config.name(config.rank) +
                        " for now: " + welcome.reason);
  }
  if (!welcome.accepted) {
    throw ConfigError(server() + " refused " + config.name(config.rank) + ": " + welcome.reason);
  }
  if (config.token &&
      (!welcome.has_mac || !equal_secret(welcome.mac, chief_mac(*config.token, hello.nonce,
                                                                join.client_nonce, config.rank)))) {
    throw ConfigError("the process at " + chief_ +
                      " could not prove it holds the cluster token; it is not this "
                      "cluster's chief (check TF_CONFIG and FLOTILLA_CLUSTER_TOKEN)");
  }
}

} // namespace flotilla::collective::detail
