// Members' reachability probes over real UDP sockets on loopback: who answers, and who must not.
#include "flotilla/rendezvous/probe.h"

#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <string>
#include <vector>

namespace flotilla::collective::detail {
namespace {

// A loopback UDP port nothing listens on (bound, read, closed).
std::string closed_port() {
  const int fd = ::socket(AF_INET, SOCK_DGRAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t n = sizeof a;
  ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &n);
  ::close(fd);
  return "127.0.0.1:" + std::to_string(ntohs(a.sin_port));
}

TEST(Probe, OnlyAResponderWithTheSameTokenAnswers) {
  const ProbeResponder same("127.0.0.1", std::string("secret"));
  const ProbeResponder other("127.0.0.1", std::string("another cluster"));
  const ProbeResponder none("127.0.0.1", std::nullopt);
  EXPECT_EQ(same.address().rfind("127.0.0.1:", 0), 0u) << same.address();
  const std::vector<std::pair<int, std::string>> peers = {{0, same.address()},
                                                          {1, other.address()},
                                                          {2, none.address()},
                                                          {3, closed_port()},
                                                          {4, "not an address"}};
  EXPECT_EQ(unreachable(peers, std::string("secret"), std::chrono::milliseconds(600)),
            (std::vector<int>{1, 2, 3, 4}));
  // Without a token, the proof is made with the empty key: only a responder without one answers.
  EXPECT_EQ(unreachable(peers, std::nullopt, std::chrono::milliseconds(600)),
            (std::vector<int>{0, 1, 3, 4}));
  EXPECT_TRUE(unreachable({}, std::nullopt, std::chrono::milliseconds(600)).empty());
}

// A stranger's datagrams (wrong size, wrong proof, an answer instead of a question) get nothing
// back, and the responder still answers a member afterwards.
TEST(Probe, AStrangersDatagramsGetNoAnswer) {
  const ProbeResponder responder("127.0.0.1", std::string("secret"));
  const auto colon = responder.address().rfind(':');
  sockaddr_in to{};
  to.sin_family = AF_INET;
  to.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  to.sin_port = htons(static_cast<std::uint16_t>(std::stoi(responder.address().substr(colon + 1))));
  const int fd = ::socket(AF_INET, SOCK_DGRAM, 0);
  ASSERT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&to), sizeof to), 0);
  timeval wait{0, 300000};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &wait, sizeof wait);
  std::string ask = "FLPROBE1";
  ask += '\x01';
  ask += std::string(16 + 32, 'x'); // the right shape, a wrong proof
  for (const std::string& sent : {ask, ask.substr(0, 20), std::string(1000, '\x01')}) {
    ::send(fd, sent.data(), sent.size(), 0);
    char in[128];
    EXPECT_LT(::recv(fd, in, sizeof in, 0), 0) << "answered " << sent.size() << " bytes";
  }
  ::close(fd);
  EXPECT_TRUE(
      unreachable({{0, responder.address()}}, std::string("secret"), std::chrono::milliseconds(600))
          .empty());
}

} // namespace
} // namespace flotilla::collective::detail
