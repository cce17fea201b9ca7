// Elastic membership: a group that survives its members. The rendezvous runs outside the
// workers (RendezvousService: `flotilla rendezvous` on a cluster, inside `flotilla launch
// --elastic` on one machine) and is the one arbiter of who is in the group. Membership moves in
// generations: generation 0 forms when every worker of the cluster has joined; when a member
// dies, leaves, or falls silent for heartbeat_timeout, the arbiter forms the next generation
// from the rest at once, and a restarted worker waits until the members admit it at a step
// boundary. Each generation is a fresh c10d process group (Gloo, NCCL) whose ranks are dense in
// slot order (a slot is a task's rank in the full cluster), so the lowest surviving slot is
// rank 0 and takes over the chief's duties.
//
// What the training loop does with it (see docs/reliability.md): a collective of a generation
// that lost a member throws GroupChanged (or a CommError, when a backend noticed the dead peer
// first); the loop calls regroup(), which returns once the next generation's group is
// connected, and redoes the step. Every few step boundaries (8 in Model::fit) it asks whether
// any rank saw workers waiting (waiting() > 0, agreed by a vote) and then every member calls
// admit() together.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "flotilla/cluster/cluster_spec.h"
#include "flotilla/collective/communicator.h"
#include "flotilla/rendezvous/service.h" // RendezvousService, serve_rendezvous_replica

namespace flotilla::collective {

// One worker's membership of an elastic group, generation by generation. join() makes the real
// one (through the rendezvous); the training loop (Model::fit's healer) uses nothing but this
// interface, so a test can drive it with generations of its own.
class ElasticGroup {
 public:
  // Joins the elastic group through the rendezvous at spec.rendezvous, which must be external
  // (spec.external_rendezvous: FLOTILLA_RENDEZVOUS), claiming slot spec.rank; blocks until a
  // generation admits this worker or options.timeout passes (TimeoutError). ConfigError when
  // the rendezvous refuses (wrong token, slot taken by a live process, not elastic).
  static std::unique_ptr<ElasticGroup> join(const cluster::ClusterSpec& spec,
                                            const CommunicationOptions& options);
  virtual ~ElasticGroup() = default; // join()'s leaves: the others regroup without this worker
  ElasticGroup(const ElasticGroup&) = delete;
  ElasticGroup& operator=(const ElasticGroup&) = delete;

  // The current generation's group: rank() is this worker's place among members().
  virtual Communicator& communicator() = 0;
  virtual std::uint64_t generation() const = 0;
  virtual const std::vector<int>& members() const = 0; // slots, in rank order
  virtual int slot() const = 0;
  // What made the current generation ("all 4 workers joined", "worker 2 at ... left ...").
  virtual const std::string& reason() const = 0;
  // From the rendezvous's last heartbeat answer: how many restarted workers wait to be admitted.
  virtual int waiting() const = 0;
  // Whether the generation this worker joined starts the training over: generation 0, or every
  // slot joined again after the whole group was lost (every member left before any finished its
  // fit). Such a worker makes fit's start-up agreements and restores from a backup on disk, if
  // any; the others join a running training and take a live peer's state.
  virtual bool starts_afresh() const = 0;
  // Tells the rendezvous that this worker's fit ran to its end: workers claiming a slot after
  // every member has left then learn there is nothing to join, instead of starting it afresh.
  virtual void training_finished() = 0;

  // After a collective of this generation failed: waits for the rendezvous to form a generation
  // without the departed member(s) (within heartbeat_timeout and a few heartbeats) and joins
  // its group; again when another member leaves while it forms. CommError when this worker was
  // expelled or the rendezvous is lost; TimeoutError when no member left (the failure was
  // something else, which the caller should report).
  virtual void regroup() = 0;
  // Every member together, at a step boundary: admits the waiting workers into a new generation
  // and joins it. False when nobody was waiting (the group is unchanged). GroupChanged when a
  // member left meanwhile (then regroup()).
  virtual bool admit() = 0;
  // After each step, before anything acts on it: CommError when this worker has been expelled.
  // Only a worker that did not get here for longer than a heartbeat interval since the last call
  // (stopped, starved, a step that slow) can have been (the rendezvous counts its silence from
  // its last ping), and only then does it ask the rendezvous; otherwise it reads the clock. Such
  // a worker's step may have completed against collectives its old group abandoned when it
  // regrouped without it.
  virtual void confirm_membership() = 0;

 protected:
  ElasticGroup() = default;
};

} // namespace flotilla::collective
