// Private: the rendezvous's rules of membership as a state machine with no sockets, no store and
// no clock of its own: slots (the ranks of the full cluster), which process holds each, and, in
// elastic mode, the generations. Every transition returns what changed (the generations it
// formed, what to tell the operator); the server applies that to its store and connections.
//
// Elastic rules: generation 0 forms when every slot is claimed. A member that leaves (dies,
// says goodbye, is expelled) frees its slot and the rest form the next generation at once. A
// process claiming a free slot waits until the members admit it at a step boundary (advance).
// No member left: after a finished training the waiting workers form a generation at once
// (nothing to join); before it, the group is lost, and the next generation forms when every
// slot is claimed again and starts afresh.
// A restarted rendezvous starts with nothing: a member that joins it again names its generation
// and that generation's slots (resume), and the newest generation so named is taken up as it
// was; its members that do not come back within the heartbeat timeout have left.
// Fixed rules: slots are claimed once; a rank that fails keeps its failure; one that says goodbye
// has left and never fails.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "rendezvous/wire.h"

namespace flotilla::collective::detail {

class Membership {
 public:
  using Clock = std::chrono::steady_clock;

  // Elastic: what a member's ping says of its progress: the newest collective it has started
  // (its communicator's sequence number) in generation `generation`.
  struct Progress {
    std::uint64_t generation = 0;
    std::uint64_t reached = 0;
  };
  // A member's report that another never reached collective #sequence of generation
  // `generation` (`description`), in which the reporter timed out.
  struct HeldReport {
    int reporter = 0;
    std::uint64_t generation = 0;
    std::uint64_t sequence = 0;
    std::string description;
    int pings = 0; // the suspect's pings heard since
  };

  struct Slot {
    bool claimed = false;
    Session session{};
    std::string peer;
    bool heartbeating = false;
    Clock::time_point last_seen;
    bool left = false;   // fixed: said goodbye
    std::string failure; // fixed: why it failed; empty while healthy
    bool member = false; // elastic: in the newest generation (not claimed yet: a member
                         // of before a restart, expected back by last_seen + the timeout)
    // Elastic: claimed by a process that named an older generation (resume). Not a member of
    // the newest, it is stale: never admitted (its state is of before), it learns it was
    // expelled when it regroups.
    bool resumed = false;
    Progress said;                  // elastic: what its newest ping said
    std::optional<HeldReport> held; // elastic: a report that it never reached a collective
  };

  // A generation formed by a transition.
  struct Generation {
    std::uint64_t number = 0;
    std::vector<int> slots;
    std::string why;
    bool departure = false; // formed because a member left (older generations can never meet)
    bool afresh = false;    // the training starts over (generation 0, or after the group was lost)
    bool resumed = false;   // taken up from its members by a restarted server
    // "slot,slot,..."
    std::string slot_list() const;
    // kGenerationKey's value: slot_list(), "\n", why, and a third line "afresh" when it is.
    std::string record() const;
  };

  // What a transition changed, for the server to apply in order.
  struct Changes {
    std::vector<Generation> formed;
    std::vector<std::string> info, warnings;
  };

  // `name(slot)` names a slot in messages ("worker 1").
  Membership(int world_size, bool elastic, std::function<std::string(int)> name);

  int world_size() const { return static_cast<int>(slots_.size()); }
  const Slot& slot(int s) const { return slots_.at(static_cast<std::size_t>(s)); }

  // Why a process with `session` may not claim slot `s` (as its store connection, or as its
  // heartbeat when `heartbeat`); "" when it may.
  std::string why_refused(int s, const Session& session, bool heartbeat) const;
  // Slot `s`'s store connection joined (again, for the same process).
  Changes claim(int s, const Session& session, const std::string& peer);
  // Elastic, on a restarted server: slot `s`'s process was a member of generation `g` of
  // `slots` (ascending, `s` among them). The first such claim, or one naming a newer
  // generation, makes `g` the newest (formed[0] records it, marked resumed); each of its
  // members not claimed yet is expected back within the heartbeat timeout of `now`
  // (silent()). A member of an older generation claims its slot and learns of the newer one as
  // after any change (intact_from).
  Changes resume(int s, const Session& session, const std::string& peer, std::uint64_t g,
                 const std::vector<int>& slots, Clock::time_point now);
  void start_heartbeat(int s, Clock::time_point now);
  // Slot `s` pinged at `now`, saying `progress` (elastic). The report to expel it for, when one
  // holds it (reported_silent) and this is its second ping since that still says it never
  // started that collective: a heartbeat has one ping in flight at a time, so the second was
  // sent after the report arrived. A ping saying it did start it clears the report.
  std::optional<HeldReport> heard_from(int s, Clock::time_point now, Progress progress);
  void heard_from(int s, Clock::time_point now) { heard_from(s, now, Progress()); }
  // Elastic: slot `s`'s process is gone ("<name> <what>"); its slot is free again. `finished`:
  // a member's fit has run to its end.
  Changes release(int s, const std::string& what, bool finished);
  // Elastic: the members of generation `from` admit the waiting workers (idempotent: the first
  // member's request forms the next generation, the others' find it formed). Returns the newest
  // generation's number.
  std::uint64_t advance(std::uint64_t from, Changes& changes);
  // Elastic: the member in slot `reporter` timed out in collective #`sequence` (`description`)
  // of generation `g`, which ranks `ranks` of that generation did not say they had reached (a
  // hang outside the collectives while the heartbeat thread runs, or a member that came late or
  // whose own timeout fired later on a loaded machine). Those ranks' slots are held as suspects
  // until their heartbeat says where they are (heard_from), unless its newest ping says it has
  // started that collective already. Returns the slots held; none for a late or stale report
  // (`g` not the newest generation, the reporter no member of it). A slot held already keeps
  // its first report.
  std::vector<int> reported_silent(int reporter, std::uint64_t g, std::uint64_t sequence,
                                   const std::vector<int>& ranks, const std::string& description);
  // Elastic: after a collective of generation `g` failed and no member left, the member in slot
  // `reporter` probed the others directly and could not reach `ranks` of that generation (maybe
  // none). Kept until the next generation forms; a late or stale report is dropped.
  void reported_unreachable(int reporter, std::uint64_t g, const std::vector<int>& ranks,
                            Clock::time_point now);
  // Elastic: the slots on the losing side of a partition between members that all reach the
  // rendezvous. Decided once every member of the newest generation has reported, or `window`
  // after the first report: the members outside the largest set of members that reach each
  // other (of sets equally large, the one with the lowest slots, the chief's side) lose. Empty
  // until then, when every member reached every other, or once decided for this generation.
  std::vector<int> partitioned(Clock::time_point now, Clock::duration window);
  // Fixed: slot `s` failed (its first failure is kept; not after it left) / said goodbye.
  void fail(int s, const std::string& what);
  void leave(int s) { at(s).left = true; }
  // The healthy heartbeating slots silent for longer than `timeout` at `now`, and the members
  // of a resumed generation not back within it.
  std::vector<int> silent(Clock::time_point now, Clock::duration timeout) const;
  // The server did not run for `gap` until `now` (it was stopped): nobody could be heard in
  // it, so no silence counts it.
  void paused(Clock::duration gap, Clock::time_point now);

  bool formed() const { return formed_; }
  std::uint64_t generation() const { return generation_; }
  // No member has left a generation numbered this or higher.
  std::uint64_t intact_from() const { return intact_from_; }
  // Claimed slots that are not members of the newest generation (stale ones aside).
  int waiting() const;
  // The newest departure of a member (slot, why); slot -1 before any.
  const std::pair<int, std::string>& last_departure() const { return last_departure_; }
  // Fixed: (slot, why) of every failed slot.
  std::vector<std::pair<int, std::string>> failures() const;

 private:
  Slot& at(int s) { return slots_.at(static_cast<std::size_t>(s)); }
  // A fresh process waiting to be admitted.
  static bool waits(const Slot& x) { return x.claimed && !x.member && !x.resumed; }
  std::vector<int> slots_where(const std::function<bool(const Slot&)>& pick) const;
  // The slots of `ranks` of generation g, the reporter and repeats left out; nullopt unless g is
  // the newest generation and the reporter one of its members (a late or stale report).
  std::optional<std::vector<int>> slots_reported(int reporter, std::uint64_t g,
                                                 const std::vector<int>& ranks) const;
  void form(Changes& changes, const std::vector<int>& slots, const std::string& why, bool departure,
            bool afresh = false);
  void form_afresh_when_all_claimed(Changes& changes);

  std::vector<Slot> slots_;
  bool elastic_;
  std::function<std::string(int)> name_;
  bool formed_ = false;
  std::uint64_t generation_ = 0;
  std::uint64_t intact_from_ = 0;
  bool lost_ = false;
  std::pair<int, std::string> last_departure_{-1, ""};
  // Partition reports of the newest generation: reporter slot -> the slots it could not reach.
  std::vector<std::pair<int, std::vector<int>>> unreachable_;
  Clock::time_point first_report_;
  bool partition_decided_ = false;
};

} // namespace flotilla::collective::detail
