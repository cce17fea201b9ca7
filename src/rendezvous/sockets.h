// Private: the few socket helpers the rendezvous server and its clients share.
#pragma once

#include <netdb.h>
#include <sys/socket.h>

#include <chrono>
#include <string>

#include "flotilla/cluster/cluster_spec.h"

namespace flotilla::collective::detail {

// getaddrinfo's list, freed with its owner.
struct AddrInfo {
  addrinfo* list = nullptr;
  AddrInfo() = default;
  AddrInfo(const AddrInfo&) = delete;
  AddrInfo& operator=(const AddrInfo&) = delete;
  ~AddrInfo() {
    if (list) ::freeaddrinfo(list);
  }
};

// The chief's address as TCP endpoints; ConfigError naming the host when it does not resolve.
void resolve(const cluster::Address& address, AddrInfo& out);

void set_nonblocking(int fd);
// Makes `fd` non-blocking, starts a connect to `a` and waits for it, at most 2 s at a time (the
// caller retries until its deadline); false with errno set when it failed.
bool connect_within(int fd, const addrinfo* a, std::chrono::steady_clock::time_point deadline);
void set_nodelay(int fd);

// "127.0.0.1:4321" or "[::1]:4321": how messages name a connection's other end.
std::string peer_name(const sockaddr_storage& addr);

} // namespace flotilla::collective::detail
