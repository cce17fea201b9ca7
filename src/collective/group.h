// Private: how collective::ElasticGroup (src/collective/elastic.cpp) makes one Communicator per
// generation (over a store of its own), the failure state a generation's operations watch
// (Health), and how messages name the ranks.
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "flotilla/rendezvous/config.h"
#include "flotilla/cluster/cluster_spec.h"
#include "flotilla/collective/communicator.h"
#include "flotilla/collective/elastic.h"

namespace flotilla::collective {
struct Health;
} // namespace flotilla::collective

namespace flotilla::collective::detail {

// A group of `size` ranks whose backends meet under `store`; its operations fail once `health`
// does (fail_group).
Communicator make_group(int rank, int size, const CommunicationOptions& options,
                        c10::intrusive_ptr<c10d::Store> store, const std::string& local_host,
                        std::vector<std::string> names, std::shared_ptr<Health> health);

// How an elastic generation's group is made: make_group's signature. A benchmark passes a
// stand-in (bench/scale.cpp replays the backends' address exchange without connecting them).
using GroupFactory = std::function<Communicator(
    int rank, int size, const CommunicationOptions& options,
    c10::intrusive_ptr<c10d::Store> store, const std::string& local_host,
    std::vector<std::string> names, std::shared_ptr<Health> health)>;

// ElasticGroup::join, each generation's group made by `make`.
std::unique_ptr<ElasticGroup> join_elastic(const cluster::ClusterSpec& spec,
                                           const CommunicationOptions& options,
                                           GroupFactory make);

// Blocks until `health` failed (fail_group) or `timeout` passed; whether it failed.
bool wait_until_failed(Health& health, std::chrono::milliseconds timeout);

// Fencing: a generation being replaced is cut off before the next forms. Its Gloo connections
// are reset, so no collective of it can complete any more, neither here nor on a member that
// was stopped and wakes to finish one against the work this process abandoned. Call it on the
// thread that issued the group's operations, after it stopped issuing them.
void sever_group(Communicator& group);

std::shared_ptr<Health> new_health();
// The sequence number of the newest operation started on the group watching `health` (for the
// heartbeat's pings: Standing::reached).
std::shared_ptr<const std::atomic<std::uint64_t>> reached_of(const std::shared_ptr<Health>& health);
// Every operation of the groups watching `health` fails from now on, naming `why`: with
// GroupChanged when `changed` (the membership moved on), with CommError otherwise. The first
// call wins; false when it had failed already.
bool fail_group(Health& health, const std::string& why, bool changed);
bool group_failed(const Health& health);

// The rendezvous settings of task `spec` under `options` (rendezvous_config of
// flotilla/rendezvous/config.h, from the options' rendezvous fields).
RendezvousConfig rendezvous_config(const cluster::ClusterSpec& spec,
                                   const CommunicationOptions& options);

} // namespace flotilla::collective::detail
