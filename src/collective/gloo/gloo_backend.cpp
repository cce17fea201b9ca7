// The only translation unit that includes Gloo: c10d's ProcessGroupGloo over Gloo's TCP pairs.
#include <gloo/common/error.h>
#include <gloo/context.h>
#include <signal.h>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include <cstdlib>
#include <mutex>

#include "collective/backends.h"

namespace flotilla::collective::detail {
namespace {

// Gloo's TCP pairs write with writev(), which raises SIGPIPE once the peer's socket is gone (a
// worker that died, or one cut off whose connection was reset). By default that signal kills
// this process, a survivor, instead of failing the operation with EPIPE. Python ignores
// SIGPIPE at start-up, which is why PyTorch never shows this; a C++ program has to do it.
// Left alone where the program chose a disposition of its own.
void ignore_sigpipe() {
  static std::once_flag once;
  std::call_once(once, [] {
    struct sigaction current {};
    if (::sigaction(SIGPIPE, nullptr, &current) != 0 || current.sa_handler != SIG_DFL) return;
    struct sigaction ignore {};
    ignore.sa_handler = SIG_IGN;
    sigemptyset(&ignore.sa_mask);
    ::sigaction(SIGPIPE, &ignore, nullptr);
  });
}

// How a forming group learns its peers' addresses, through the rendezvous store. Gloo's
// defaults make each rank's record list a pair identifier for every rank and read every
// record with its own wait and get: 8·W³ bytes and 2·W² requests per group of W, 8.6 GB and two
// million requests at 1024 ranks (bench/scale.cpp measures it). With
// GLOO_ENABLE_RANK_AS_SEQUENCE_NUMBER a pair is known by its rank instead, so a record is
// about 170 bytes whatever W; with GLOO_ENABLE_STORE_V2_API the records are read 128 per request
// (RendezvousStore's multiGet). Every worker must agree on the first, so a user's own setting of
// either wins, and must be the same on all of them. Set before this process's first group.
void exchange_addresses_compactly() {
  static std::once_flag once;
  std::call_once(once, [] {
    ::setenv("GLOO_ENABLE_RANK_AS_SEQUENCE_NUMBER", "1", /*overwrite=*/0);
    ::setenv("GLOO_ENABLE_STORE_V2_API", "1", /*overwrite=*/0);
  });
}

// ProcessGroupGloo with a way to close its connections while its threads may still wait on
// them: the pairs are reset (SO_LINGER 0, then closed), so a peer's operation on them fails at
// once with a transport error instead of completing against work this process abandoned.
class FencedGloo final : public c10d::ProcessGroupGloo {
 public:
  using ProcessGroupGloo::ProcessGroupGloo;
  void close_connections() {
    for (auto& context : contexts_) {
      if (context) context->closeConnections();
    }
  }
};

} // namespace

void close_gloo_connections(c10d::Backend& backend) {
  if (auto* gloo = dynamic_cast<FencedGloo*>(&backend)) gloo->close_connections();
}

c10::intrusive_ptr<c10d::Backend> make_gloo_backend(const c10::intrusive_ptr<c10d::Store>& store,
                                                    int rank, int size,
                                                    const std::string& local_host,
                                                    std::chrono::milliseconds timeout) {
  ignore_sigpipe();
  exchange_addresses_compactly();
  auto options = c10d::ProcessGroupGloo::Options::create(timeout);
  options->devices.push_back(local_host.empty()
                                 ? c10d::ProcessGroupGloo::createDefaultDevice()
                                 : c10d::ProcessGroupGloo::createDeviceForHostname(local_host));
  return c10::make_intrusive<FencedGloo>(store, rank, size, options);
}

bool is_gloo_transport_error(const std::exception& e) {
  return dynamic_cast<const ::gloo::IoException*>(&e) != nullptr;
}

} // namespace flotilla::collective::detail
