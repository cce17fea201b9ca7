// The rendezvous as a service of its own (`flotilla rendezvous`, `flotilla launch --elastic`),
// outside the workers: the one arbiter of an elastic group's membership (collective/elastic.h),
// and the replicas that keep one in an etcd cluster.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "flotilla/cluster/cluster_spec.h"

namespace flotilla::collective {

// The rendezvous as a service of its own, bound to `listen` only: the store through which each
// generation's backends meet, the heartbeats, and (elastic) the generations. It keeps serving
// while workers come and go, until it is destroyed.
class RendezvousService {
 public:
  struct Options {
    cluster::Address listen;                  // port 0: the kernel picks one (port())
    int workers = 1;                          // slots: every training task of the cluster
    std::optional<std::string> cluster_token; // as the workers' CommunicationOptions
    bool insecure = false; // without a token, listen on more than loopback anyway (as above)
    bool elastic = true;   // false: a fixed group, as the chief would host
    std::chrono::milliseconds heartbeat_timeout{10000}; // a member silent this long is expelled
  };
  explicit RendezvousService(const Options& options);
  ~RendezvousService();
  RendezvousService(const RendezvousService&) = delete;
  RendezvousService& operator=(const RendezvousService&) = delete;

  int port() const;
  // "host:port", the value for FLOTILLA_RENDEZVOUS.
  std::string address() const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

// One replica of a rendezvous kept in an etcd cluster (FLOTILLA_RENDEZVOUS=etcd://...; `flotilla
// rendezvous --etcd`): start one on each of several hosts. Each campaigns for the job's key
// (cluster::EtcdRendezvous::key) under a lease of the heartbeat timeout (at least 5 s); the one
// that creates it listens on options.listen and serves, renewing the lease, while the others
// stand by without listening. The serving one stops serving once it has not renewed the lease for
// three quarters of it (cut off from etcd's quorum: before etcd lets the lease expire and another
// replica takes the key), then campaigns again. The workers find the serving replica in etcd and
// join it again as they join a restarted rendezvous (its state comes back from them). Returns once
// `stopping()` is true, giving the key up at once. `say` gets each change of role.
void serve_rendezvous_replica(const RendezvousService::Options& options,
                              const cluster::EtcdRendezvous& etcd,
                              const std::function<bool()>& stopping,
                              const std::function<void(const std::string&)>& say);

} // namespace flotilla::collective
