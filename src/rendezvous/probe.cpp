#include "flotilla/rendezvous/probe.h"

#include <poll.h>
#include <unistd.h>

#include <cstring>

#include "rendezvous/sockets.h"
#include "rendezvous/wire.h"
#include "flotilla/base/hashes.h"
#include "flotilla/cluster/cluster_spec.h"
#include "flotilla/error.h"

namespace flotilla::collective::detail {
namespace {

// "FLPROBE1", the kind (1 ask, 2 answer), a 16-byte nonce, HMAC-SHA256 of what precedes it.
constexpr char kMagic[] = "FLPROBE1";
constexpr std::size_t kHead = 8 + 1 + 16;
constexpr std::size_t kSize = kHead + 32;
constexpr std::uint8_t kAsk = 1, kAnswer = 2;
constexpr int kAnswersPerSecond = 200;

using Datagram = std::array<std::uint8_t, kSize>;

Datagram make(std::uint8_t kind, const std::uint8_t* nonce,
              const std::optional<std::string>& token) {
  Datagram d{};
  std::memcpy(d.data(), kMagic, 8);
  d[8] = kind;
  std::memcpy(d.data() + 9, nonce, 16);
  const auto mac = base::hmac_sha256(token.value_or(""),
                                     std::string(reinterpret_cast<const char*>(d.data()), kHead));
  std::memcpy(d.data() + kHead, mac.data(), 32);
  return d;
}

// A datagram of `kind`, proven with the token.
bool valid(const std::uint8_t* d, ssize_t n, std::uint8_t kind,
           const std::optional<std::string>& token) {
  if (n != static_cast<ssize_t>(kSize) || std::memcmp(d, kMagic, 8) != 0 || d[8] != kind) {
    return false;
  }
  const Datagram expected = make(kind, d + 9, token);
  return equal_secret(expected.data() + kHead, d + kHead, 32);
}

int udp_socket(int family) {
  const int fd = ::socket(family, SOCK_DGRAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) throw Error(std::string("cannot open a UDP socket: ") + std::strerror(errno));
  return fd;
}

} // namespace

ProbeResponder::ProbeResponder(const std::string& host, std::optional<std::string> token)
    : token_(std::move(token)) {
  std::string name = host;
  if (name.empty()) {
    char buffer[256] = {};
    ::gethostname(buffer, sizeof buffer - 1);
    name = buffer;
  }
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_DGRAM;
  AddrInfo found;
  if (const int rc = ::getaddrinfo(name.c_str(), "0", &hints, &found.list); rc != 0) {
    throw Error("cannot resolve \"" + name + "\" to answer probes on: " + ::gai_strerror(rc));
  }
  fd_ = udp_socket(found.list->ai_family);
  sockaddr_storage bound{};
  socklen_t length = sizeof bound;
  if (::bind(fd_, found.list->ai_addr, found.list->ai_addrlen) != 0 ||
      ::getsockname(fd_, reinterpret_cast<sockaddr*>(&bound), &length) != 0) {
    const std::string why = std::strerror(errno);
    ::close(fd_);
    throw Error("cannot bind a UDP socket on \"" + name + "\" to answer probes: " + why);
  }
  address_ = peer_name(bound);
  thread_ = std::thread([this] { serve(); });
}

ProbeResponder::~ProbeResponder() {
  stop_ = true;
  if (thread_.joinable()) thread_.join();
  ::close(fd_);
}

void ProbeResponder::serve() {
  auto window = std::chrono::steady_clock::now();
  int answered = 0;
  while (!stop_) {
    pollfd p{fd_, POLLIN, 0};
    if (::poll(&p, 1, 200) <= 0) continue;
    std::uint8_t in[kSize + 1];
    sockaddr_storage from{};
    socklen_t length = sizeof from;
    const ssize_t n =
        ::recvfrom(fd_, in, sizeof in, 0, reinterpret_cast<sockaddr*>(&from), &length);
    if (!valid(in, n, kAsk, token_)) continue;
    const auto now = std::chrono::steady_clock::now();
    if (now - window >= std::chrono::seconds(1)) window = now, answered = 0;
    if (++answered > kAnswersPerSecond) continue;
    const Datagram answer = make(kAnswer, in + 9, token_);
    ::sendto(fd_, answer.data(), answer.size(), 0, reinterpret_cast<sockaddr*>(&from), length);
  }
}

std::vector<int> unreachable(const std::vector<std::pair<int, std::string>>& peers,
                             const std::optional<std::string>& token,
                             std::chrono::milliseconds wait) {
  struct Asked {
    int rank;
    int fd = -1;
    std::array<std::uint8_t, 16> nonce{};
    bool answered = false;
  };
  std::vector<Asked> asked;
  std::vector<int> out;
  for (const auto& [rank, text] : peers) {
    Asked a{rank};
    try {
      const cluster::Address address = cluster::parse_address(text, "a probe address");
      AddrInfo found;
      resolve(address, found);
      a.fd = udp_socket(found.list->ai_family);
      // Connected: only this peer's datagrams arrive, and a refusal (ICMP) is an answer too.
      if (::connect(a.fd, found.list->ai_addr, found.list->ai_addrlen) != 0) {
        ::close(a.fd);
        a.fd = -1;
      }
    } catch (const Error&) {
      a.fd = -1;
    }
    if (a.fd < 0) {
      out.push_back(rank);
      continue;
    }
    a.nonce = random_bytes<16>();
    asked.push_back(a);
  }
  const auto deadline = std::chrono::steady_clock::now() + wait;
  for (int round = 0; round < 3; ++round) {
    for (auto& a : asked) {
      if (a.answered || a.fd < 0) continue;
      const Datagram ask = make(kAsk, a.nonce.data(), token);
      ::send(a.fd, ask.data(), ask.size(), MSG_NOSIGNAL);
    }
    const auto round_end = std::chrono::steady_clock::now() + wait / 3;
    for (;;) {
      std::vector<pollfd> fds;
      for (auto& a : asked) {
        if (!a.answered && a.fd >= 0) fds.push_back({a.fd, POLLIN, 0});
      }
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
          std::min(round_end, deadline) - std::chrono::steady_clock::now());
      if (fds.empty() || left.count() <= 0) break;
      if (::poll(fds.data(), fds.size(), static_cast<int>(left.count())) <= 0) continue;
      for (auto& a : asked) {
        if (a.answered || a.fd < 0) continue;
        std::uint8_t in[kSize + 1];
        const ssize_t n = ::recv(a.fd, in, sizeof in, 0);
        if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK) {
          ::close(a.fd); // refused: nothing listens there any more
          a.fd = -1;
        } else if (valid(in, n, kAnswer, token) && std::memcmp(in + 9, a.nonce.data(), 16) == 0) {
          a.answered = true;
        }
      }
    }
  }
  for (auto& a : asked) {
    if (!a.answered) out.push_back(a.rank);
    if (a.fd >= 0) ::close(a.fd);
  }
  std::sort(out.begin(), out.end());
  return out;
}

} // namespace flotilla::collective::detail
