// The rendezvous's wire protocol: every message a stranger can send the server before joining
// (JoinRequest) and every answer a worker reads from whoever listens at the chief's address
// (Hello, Welcome, Pong). A parser may refuse any input, with WireError (the server drops the
// connection) or a flotilla::Error; anything else, a crash or a sanitizer finding is a bug. What
// parses must survive its own round trip.
#include "rendezvous/wire.h"
#include "tests/fuzz/fuzz_support.h"

namespace {

using namespace flotilla::collective::detail;

template <class F> void refusing_only_with_wire_errors(F&& parse) {
  try {
    flotilla::fuzz::expect_only_flotilla_errors(parse);
  } catch (const WireError&) {
    // A malformed message: the connection is dropped.
  }
}

void check(bool ok) {
  if (!ok) __builtin_trap(); // a round trip that changed the message
}

} // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size == 0) return 0;
  const std::string body(reinterpret_cast<const char*>(data) + 1, size - 1);
  refusing_only_with_wire_errors([&] {
    switch (data[0] % 4) {
    case 0: {
      const Hello hello = Hello::parse(body);
      const Hello again = Hello::parse(hello.frame().substr(4));
      check(again.auth_required == hello.auth_required && again.nonce == hello.nonce);
      break;
    }
    case 1: {
      const auto join = JoinRequest::parse(body);
      if (!join) break;
      const auto again = JoinRequest::parse(join->frame().substr(4));
      check(again && again->role == join->role && again->flags == join->flags &&
            again->rank == join->rank && again->world == join->world &&
            again->session == join->session && again->mac == join->mac &&
            again->generation == join->generation && again->members == join->members);
      break;
    }
    case 2: {
      const Welcome welcome = Welcome::parse(body);
      const Welcome again = Welcome::parse(welcome.frame().substr(4));
      check(again.accepted == welcome.accepted && again.reason == welcome.reason);
      break;
    }
    default: {
      const int world = 1 + (data[0] >> 2) % 16;
      const Pong pong = Pong::parse(body, world);
      check(static_cast<int>(pong.failed.size()) <= world);
      const Pong again = Pong::parse(pong.frame().substr(4), world);
      check(again.failed == pong.failed && again.generation == pong.generation &&
            again.waiting == pong.waiting && again.expelled == pong.expelled);
      break;
    }
    }
  });
  return 0;
}
