// The control plane: flotilla's rendezvous. The chief (or `flotilla rendezvous`, or a replica
// named in etcd) hosts a small key-value store through which Gloo and NCCL find each other, and
// watches the group's health. It replaces c10d's TCPStore for three reasons: the server binds
// only to its address (not every interface); a process must prove it holds the cluster token
// (HMAC-SHA256 challenge-response, both ways) and claim a free rank before it may read or write
// anything; and every length or count read from the network is checked against a bound before
// anything is allocated for it.
//
// The heartbeat: each rank keeps a second connection to the server and pings it every
// heartbeat_interval; the server declares a rank failed when its connection closes without a
// goodbye (the process died) or when it has been silent for heartbeat_timeout (stopped, hung,
// cut off), and tells every other rank in its next answer. A rank that hears nothing from the
// server for heartbeat_timeout declares it failed; in elastic mode (an outside rendezvous) it
// waits for it instead, and joins it again once it is back (see heartbeat.h). So a dead or frozen
// peer is known everywhere within about heartbeat_timeout, between collectives as well as inside
// one.
//
// A module of its own (src/rendezvous), below the data plane (collective: the communicator,
// shared memory, the backends), which sees only these public headers:
//   config.h       this: the configuration, and the policy that makes it (authentication)
//   server.h       the server: one epoll loop, the joins, the heartbeats' bookkeeping
//   store.h        a rank's connection to it as a c10d::Store, for Gloo and NCCL
//   heartbeat.h    a rank's heartbeat, on a connection and thread of its own
//   probe.h        members probing each other after a failed collective (partitions)
//   reports.h      what members report through the store, and the heartbeat's answer
//   agent_store.h  meeting under torchrun's agent store
//   service.h      the rendezvous as a service of its own, and its etcd replicas
// Its internals, from the bytes up, are private (src/rendezvous): wire.h (the protocol),
// kv_store.h (what the store holds and answers), sockets.h, membership.h (generations),
// connection.h (a client connection), etcd.h (the etcd client).
// The code keeps the namespace flotilla::collective, as the public names had before the module
// was split out, so a program written against them still compiles.
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "flotilla/cluster/cluster_spec.h"

namespace flotilla::collective::detail {

// Elastic: the generation this process is a member of, shared by its store and heartbeat
// connections. A connection that reconnects to a restarted rendezvous names it (kJoinMember),
// so the server rebuilds the membership from the members.
struct Standing {
  std::mutex mutex;
  bool member = false;
  std::uint64_t generation = 0;
  std::vector<int> slots;
  // The newest collective this process has started in `generation` (its communicator's sequence
  // number): every ping says it, so a report that this member never reached a collective is
  // checked against what it said (Membership::heard_from).
  std::shared_ptr<const std::atomic<std::uint64_t>> reached;
};

struct RendezvousConfig {
  int rank = 0;
  int world_size = 1;
  cluster::Address chief;                    // where the server listens and the clients connect
  std::optional<std::string> token;          // the shared secret; nullopt: nobody is asked for one
  std::chrono::milliseconds timeout{300000}; // joining, and each blocking store operation
  std::chrono::milliseconds heartbeat_interval{1000};
  std::chrono::milliseconds heartbeat_timeout{10000};
  // The server drops a connection that has not completed its join by then, so a silent or
  // stalled client cannot hold one of its few connection slots for long.
  std::chrono::milliseconds join_timeout{10000};
  // How to name each rank in messages, e.g. "worker 1 at 198.18.0.3:2222 (rank 2)"; empty:
  // "rank r".
  std::vector<std::string> names;
  // Elastic mode (see rendezvous_server.h): members come and go in generations; every task of a
  // group and its server must agree on it.
  bool elastic = false;
  // The server is not a training rank (`flotilla rendezvous`, `flotilla launch --elastic`):
  // messages name "the rendezvous at host:port", not the chief.
  bool external = false;
  // Random, one per process: the store and heartbeat connections of one process share it, and
  // a rank already claimed by another session is refused.
  std::array<std::uint8_t, 16> session{};
  // Elastic: set, the connections reconnect when the rendezvous is lost (it died, or the
  // connection broke), until `timeout`, naming this process's generation; null, a lost
  // rendezvous is an error at once.
  std::shared_ptr<Standing> standing;
  // Set: where the rendezvous is now, asked before each connection (FLOTILLA_RENDEZVOUS=etcd://:
  // the replica etcd names; nullopt while none is named), and how messages name it until then.
  std::function<std::optional<cluster::Address>()> locate;
  std::string locate_name;

  std::string name(int r) const;
  // "chief at 198.18.0.1:2222 (rank 0), which hosts the rendezvous" or "the rendezvous at
  // 198.18.0.9:29400": who answers the heartbeats.
  std::string server_name() const;
};

// What a task's rendezvous settings are made of (from collective::CommunicationOptions).
struct RendezvousOptions {
  std::optional<std::string> cluster_token;
  bool insecure = false; // without a token, reachable from other hosts anyway (with a warning)
  std::chrono::milliseconds timeout{300000};
  std::chrono::milliseconds heartbeat_interval{1000};
  std::chrono::milliseconds heartbeat_timeout{10000};
};

// The rendezvous settings of task `spec` (a fresh session); ConfigError for a heartbeat whose
// interval is not below its timeout, an empty cluster token, or a rendezvous reachable from
// other hosts without a token (unless `insecure`).
RendezvousConfig rendezvous_config(const cluster::ClusterSpec& spec,
                                   const RendezvousOptions& options);

// Whether `host` is this machine's loopback (127.0.0.0/8, ::1, localhost): nothing from another
// host reaches it. A name is taken as reachable from others.
bool loopback_host(const std::string& host);
// ConfigError when a rendezvous that others can reach (at `where`: `what`) would run without a
// cluster token and without `insecure`; with `insecure`, the warning that says so.
void check_authenticated(bool reachable, const std::optional<std::string>& token, bool insecure,
                         const std::string& what);

// "chief at 198.18.0.1:2222 (rank 0)", "worker 1 at 198.18.0.3:2222 (rank 2)", one per rank of
// `spec`; empty when the spec lists no addresses.
std::vector<std::string> rank_names(const cluster::ClusterSpec& spec);

// 16 random bytes for RendezvousConfig::session.
std::array<std::uint8_t, 16> new_session();

// "10 s" for whole seconds, "1500 ms" otherwise: how the rendezvous's messages say a duration.
std::string ms_text(std::chrono::milliseconds d);

} // namespace flotilla::collective::detail
