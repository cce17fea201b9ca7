// The rendezvous's membership rules without sockets: each transition of slots and generations,
// and what it reports for the server to record.
#include "rendezvous/membership.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace flotilla::collective::detail {
namespace {

using Changes = Membership::Changes;
using Clock = Membership::Clock;

Session session_of(int n) {
  Session s{};
  s[0] = static_cast<std::uint8_t>(n);
  return s;
}

Membership elastic(int world) {
  return Membership(world, /*elastic=*/true, [](int s) { return "worker " + std::to_string(s); });
}

// Claims every slot, each by its own process: generation 0.
Membership formed(int world) {
  Membership m = elastic(world);
  for (int s = 0; s < world; ++s) m.claim(s, session_of(s), "host" + std::to_string(s));
  return m;
}

std::vector<int> members(const Membership& m) {
  std::vector<int> out;
  for (int s = 0; s < m.world_size(); ++s) {
    if (m.slot(s).member) out.push_back(s);
  }
  return out;
}

TEST(Membership, GenerationZeroFormsWhenTheLastSlotIsClaimed) {
  Membership m = elastic(3);
  EXPECT_TRUE(m.claim(0, session_of(0), "a").formed.empty());
  EXPECT_TRUE(m.claim(2, session_of(2), "c").formed.empty());
  EXPECT_FALSE(m.formed());
  const Changes last = m.claim(1, session_of(1), "b");
  ASSERT_EQ(last.formed.size(), 1u);
  const auto& g = last.formed[0];
  EXPECT_EQ(g.number, 0u);
  EXPECT_EQ(g.slots, (std::vector<int>{0, 1, 2}));
  EXPECT_TRUE(g.afresh);
  EXPECT_FALSE(g.departure);
  EXPECT_EQ(g.record(), "0,1,2\nall 3 workers joined\nafresh");
  EXPECT_EQ(members(m), (std::vector<int>{0, 1, 2}));
  EXPECT_EQ(m.waiting(), 0);
}

TEST(Membership, ASlotHeldByAnotherProcessOrAnUnjoinedHeartbeatIsRefused) {
  Membership m = elastic(2);
  m.claim(0, session_of(7), "10.0.0.1:5000");
  EXPECT_EQ(m.why_refused(0, session_of(8), false),
            "worker 0 is already taken by the process at 10.0.0.1:5000; two tasks were given the "
            "same task type and index");
  EXPECT_EQ(m.why_refused(0, session_of(7), false), ""); // the same process again (Gloo's)
  EXPECT_EQ(m.why_refused(1, session_of(9), true),
            "a heartbeat for worker 1 from a process that has not joined");
  EXPECT_EQ(m.why_refused(0, session_of(7), true), "");
  m.start_heartbeat(0, Clock::now());
  EXPECT_EQ(m.why_refused(0, session_of(7), true),
            "a heartbeat for worker 0 from a process that has not joined"); // a second one
}

TEST(Membership, AMemberLeavingFormsTheNextGenerationAtOnceAndFailsOlderOnes) {
  Membership m = formed(3);
  const Changes c = m.release(1, "left the group", /*finished=*/false);
  ASSERT_EQ(c.formed.size(), 1u);
  EXPECT_EQ(c.formed[0].number, 1u);
  EXPECT_EQ(c.formed[0].slots, (std::vector<int>{0, 2}));
  EXPECT_TRUE(c.formed[0].departure);
  EXPECT_FALSE(c.formed[0].afresh);
  EXPECT_EQ(c.formed[0].why, "worker 1 left the group");
  EXPECT_EQ(m.intact_from(), 1u);
  EXPECT_EQ(m.last_departure().first, 1);
  EXPECT_EQ(m.last_departure().second, "worker 1 left the group");
  EXPECT_FALSE(m.slot(1).claimed); // free for a new process
  EXPECT_EQ(m.why_refused(1, session_of(42), false), "");
}

TEST(Membership, AWorkerThatLeavesBeforeItWasAdmittedChangesNoGeneration) {
  Membership m = formed(2);
  m.release(1, "lost its connection", false);
  EXPECT_TRUE(m.claim(1, session_of(5), "new").formed.empty());
  EXPECT_EQ(m.waiting(), 1);
  const Changes c = m.release(1, "lost its connection", false);
  EXPECT_TRUE(c.formed.empty());
  EXPECT_EQ(c.info, (std::vector<std::string>{"worker 1 lost its connection before it was "
                                              "admitted"}));
  EXPECT_EQ(m.generation(), 1u);
  EXPECT_EQ(m.waiting(), 0);
}

TEST(Membership, TheMembersAdmitTheWaitingWorkersOnceAtAStepBoundary) {
  Membership m = formed(3);
  m.release(2, "was killed", false); // generation 1: [0, 1]
  const Changes waiting = m.claim(2, session_of(9), "back");
  EXPECT_TRUE(waiting.formed.empty());
  EXPECT_EQ(waiting.info, (std::vector<std::string>{
                              "worker 2 (back) is waiting to be admitted at the next step"}));
  Changes first, second, stale;
  EXPECT_EQ(m.advance(1, first), 2u);
  ASSERT_EQ(first.formed.size(), 1u);
  EXPECT_EQ(first.formed[0].slots, (std::vector<int>{0, 1, 2}));
  EXPECT_EQ(first.formed[0].why, "admitted worker 2");
  EXPECT_FALSE(first.formed[0].departure);
  EXPECT_EQ(m.intact_from(), 1u); // an admission is no departure
  // The other member's request for the same boundary finds it formed; an older one changes
  // nothing either.
  EXPECT_EQ(m.advance(1, second), 2u);
  EXPECT_TRUE(second.formed.empty());
  EXPECT_EQ(m.advance(0, stale), 2u);
  EXPECT_TRUE(stale.formed.empty());
  // Nobody waiting: nothing to admit.
  Changes none;
  EXPECT_EQ(m.advance(2, none), 2u);
  EXPECT_TRUE(none.formed.empty());
}

TEST(Membership, EveryMemberLostBeforeTheEndStartsAfreshWhenAllAreBack) {
  Membership m = formed(2);
  m.release(0, "was killed", false);
  const Changes last = m.release(1, "was killed", /*finished=*/false);
  ASSERT_EQ(last.formed.size(), 1u);
  EXPECT_TRUE(last.formed[0].slots.empty()); // generation 2: nobody
  ASSERT_EQ(last.warnings.size(), 1u);
  EXPECT_EQ(last.warnings[0].rfind("every member left before the training finished", 0), 0u);
  const Changes one = m.claim(1, session_of(11), "b");
  EXPECT_TRUE(one.formed.empty());
  EXPECT_EQ(one.info, (std::vector<std::string>{"worker 1 (b) joined to start the lost training "
                                                "afresh"}));
  const Changes both = m.claim(0, session_of(10), "a");
  ASSERT_EQ(both.formed.size(), 1u);
  EXPECT_EQ(both.formed[0].number, 3u);
  EXPECT_EQ(both.formed[0].slots, (std::vector<int>{0, 1}));
  EXPECT_TRUE(both.formed[0].afresh);
  EXPECT_EQ(both.formed[0].why,
            "all 2 workers joined again after the group was lost: the training starts afresh");
}

TEST(Membership, AfterTheTrainingFinishedAWorkerThatComesLearnsThereIsNothingToJoin) {
  Membership m = formed(2);
  m.release(1, "was stopped", false); // generation 1: [0]
  m.claim(1, session_of(3), "again"); // waiting for a step boundary
  const Changes end = m.release(0, "left the group", /*finished=*/true);
  ASSERT_EQ(end.formed.size(), 1u);
  EXPECT_EQ(end.formed[0].slots, (std::vector<int>{1})); // the waiting worker, told at once
  EXPECT_TRUE(end.warnings.empty());
  m.release(1, "left the group", true);
  // A slot claimed with no member left forms a generation of the waiting workers at once.
  const Changes late = m.claim(0, session_of(4), "late");
  ASSERT_EQ(late.formed.size(), 1u);
  EXPECT_EQ(late.formed[0].slots, (std::vector<int>{0}));
  EXPECT_EQ(late.formed[0].why, "no member left to admit worker 0");
}

TEST(Membership, SilentHeartbeatsAreFoundAtTheirTimeout) {
  Membership m = formed(3);
  const auto t0 = Clock::now();
  for (int s = 0; s < 3; ++s) m.start_heartbeat(s, t0);
  m.heard_from(0, t0 + std::chrono::seconds(9));
  m.heard_from(2, t0 + std::chrono::seconds(4));
  EXPECT_EQ(m.silent(t0 + std::chrono::seconds(10), std::chrono::seconds(5)),
            (std::vector<int>{1, 2}));
  EXPECT_TRUE(m.silent(t0 + std::chrono::seconds(5), std::chrono::seconds(5)).empty());
}

// A restarted rendezvous knows nothing: the members that join it again name their generation.
TEST(Membership, ARestartedServerTakesUpTheGenerationItsMembersNameAndWaitsForTheRest) {
  Membership m = elastic(3);
  const auto t0 = Clock::now();
  const Changes first = m.resume(1, session_of(1), "b", 4, {0, 1}, t0);
  ASSERT_EQ(first.formed.size(), 1u);
  EXPECT_EQ(first.formed[0].number, 4u);
  EXPECT_EQ(first.formed[0].slots, (std::vector<int>{0, 1}));
  EXPECT_TRUE(first.formed[0].resumed);
  EXPECT_FALSE(first.formed[0].departure);
  EXPECT_FALSE(first.formed[0].afresh);
  EXPECT_EQ(first.formed[0].why,
            "taken up after the rendezvous restarted (worker 1, b, was a member)");
  EXPECT_TRUE(m.formed());
  EXPECT_EQ(m.generation(), 4u);
  EXPECT_EQ(m.intact_from(), 4u);
  EXPECT_EQ(members(m), (std::vector<int>{0, 1}));
  EXPECT_EQ(m.waiting(), 0); // slot 0 is expected back, not waiting
  // The other member of the same generation changes nothing.
  EXPECT_TRUE(m.resume(0, session_of(0), "a", 4, {0, 1}, t0).formed.empty());
  EXPECT_TRUE(m.slot(0).claimed);
  // A restarted worker that was no member waits to be admitted, as before the restart.
  EXPECT_TRUE(m.claim(2, session_of(2), "c").formed.empty());
  EXPECT_EQ(m.waiting(), 1);
  EXPECT_EQ(m.generation(), 4u);
}

TEST(Membership, ANewerGenerationNamedLaterWinsAndAnOlderOneIsToldByIntactFrom) {
  Membership m = elastic(3);
  const auto t0 = Clock::now();
  m.resume(2, session_of(2), "c", 3, {0, 1, 2}, t0); // still in generation 3 when it died
  const Changes newer = m.resume(0, session_of(0), "a", 4, {0, 1}, t0);
  ASSERT_EQ(newer.formed.size(), 1u);
  EXPECT_EQ(newer.formed[0].number, 4u);
  EXPECT_EQ(m.intact_from(), 4u); // slot 2's generation 3 must regroup, and find itself out
  EXPECT_EQ(members(m), (std::vector<int>{0, 1}));
  // Slot 2's process holds the state of before: it is never admitted as a fresh one would be.
  EXPECT_EQ(m.waiting(), 0);
  Changes none;
  EXPECT_EQ(m.advance(4, none), 4u);
  EXPECT_TRUE(none.formed.empty());
  const Changes older = m.resume(1, session_of(1), "b", 3, {0, 1, 2}, t0);
  EXPECT_TRUE(older.formed.empty());
  EXPECT_EQ(m.generation(), 4u);
  EXPECT_EQ(members(m), (std::vector<int>{0, 1}));
  // Once it left, a fresh process in its slot waits to be admitted.
  m.release(2, "exited", false);
  m.claim(2, session_of(12), "c2");
  EXPECT_EQ(m.waiting(), 1);
}

// A member cut off from a running rendezvous, which expelled it, comes back naming its old
// generation: it is stale, not admitted, and learns it was expelled when it regroups.
TEST(Membership, AMemberBackFromAGenerationReplacedWithoutItIsNeverAdmitted) {
  Membership m = formed(3);
  m.release(2, "stopped sending heartbeats", false); // generation 1: [0, 1]
  const Changes back = m.resume(2, session_of(2), "c", 0, {0, 1, 2}, Clock::now());
  EXPECT_TRUE(back.formed.empty());
  EXPECT_EQ(back.info, (std::vector<std::string>{
                           "worker 2 (c) came back from generation 0, which generation 1 replaced "
                           "without it: it is not admitted, and exits when it regroups"}));
  EXPECT_EQ(m.waiting(), 0);
  EXPECT_EQ(m.intact_from(), 1u);
}

TEST(Membership, AMemberNotBackWithinTheTimeoutIsSilentAndItsReleaseFormsTheNext) {
  Membership m = elastic(3);
  const auto t0 = Clock::now();
  m.resume(0, session_of(0), "a", 7, {0, 1, 2}, t0);
  m.start_heartbeat(0, t0);
  m.resume(1, session_of(1), "b", 7, {0, 1, 2}, t0);
  m.start_heartbeat(1, t0);
  m.heard_from(0, t0 + std::chrono::seconds(6));
  m.heard_from(1, t0 + std::chrono::seconds(6));
  EXPECT_TRUE(m.silent(t0 + std::chrono::seconds(4), std::chrono::seconds(5)).empty());
  EXPECT_EQ(m.silent(t0 + std::chrono::seconds(6), std::chrono::seconds(5)), (std::vector<int>{2}));
  const Changes gone = m.release(2, "did not come back", false);
  ASSERT_EQ(gone.formed.size(), 1u);
  EXPECT_EQ(gone.formed[0].number, 8u);
  EXPECT_EQ(gone.formed[0].slots, (std::vector<int>{0, 1}));
  EXPECT_TRUE(gone.formed[0].departure);
  EXPECT_EQ(m.intact_from(), 8u);
}

TEST(Membership, ANewProcessInTheSlotOfAMemberExpectedBackEndsThatMembership) {
  Membership m = elastic(2);
  m.resume(0, session_of(0), "a", 2, {0, 1}, Clock::now());
  const Changes c = m.claim(1, session_of(9), "new");
  ASSERT_EQ(c.formed.size(), 1u);
  EXPECT_EQ(c.formed[0].number, 3u);
  EXPECT_EQ(c.formed[0].slots, (std::vector<int>{0}));
  EXPECT_EQ(c.formed[0].why, "worker 1 did not come back after the rendezvous restarted (a new "
                             "process claimed its slot)");
  EXPECT_TRUE(m.slot(1).claimed);
  EXPECT_EQ(m.waiting(), 1); // the new process waits to be admitted
}

TEST(Membership, TimeTheServerDidNotRunIsNoWorkersSilence) {
  Membership m = formed(2);
  const auto t0 = Clock::now();
  m.start_heartbeat(0, t0);
  m.start_heartbeat(1, t0);
  // Stopped for 30 s right after hearing from both; on waking it hears slot 0 at once.
  const auto woke = t0 + std::chrono::seconds(30);
  m.heard_from(0, woke);
  m.paused(std::chrono::seconds(30), woke);
  EXPECT_TRUE(m.silent(woke + std::chrono::seconds(4), std::chrono::seconds(5)).empty());
  EXPECT_EQ(m.silent(woke + std::chrono::seconds(6), std::chrono::seconds(5)),
            (std::vector<int>{0, 1}));
  EXPECT_EQ(m.slot(0).last_seen, woke); // never later than now
}

// A member that timed out in a collective names the ranks that did not say they reached it:
// their slots are held as suspects, if the report is about the newest generation and comes from
// one of its members.
TEST(Membership, RanksReportedSilentInTheNewestGenerationAreHeldAsSuspects) {
  Membership m = formed(4);
  m.release(1, "was killed", false); // generation 1: slots [0, 2, 3] as ranks 0, 1, 2
  EXPECT_EQ(m.reported_silent(0, 1, 9, {2}, "all_reduce #9"), (std::vector<int>{3}));
  EXPECT_EQ(m.reported_silent(3, 1, 9, {0, 1}, "all_reduce #9"), (std::vector<int>{0, 2}));
  EXPECT_TRUE(m.reported_silent(0, 1, 9, {0}, "x").empty());     // never itself
  EXPECT_TRUE(m.reported_silent(0, 0, 9, {2}, "x").empty());     // an older generation: late
  EXPECT_TRUE(m.reported_silent(1, 1, 9, {2}, "x").empty());     // from a slot that is no member
  EXPECT_TRUE(m.reported_silent(0, 1, 9, {3, -1}, "x").empty()); // ranks it does not have
  EXPECT_EQ(m.slot(3).held->reporter, 0);                        // its first report stands
  EXPECT_EQ(m.slot(0).held->reporter, 3);
  EXPECT_FALSE(m.slot(1).held.has_value());
}

// A suspect is expelled when the second ping it sends after the report (the first may have been
// on its way already) still says it never started that collective; a ping saying it did clears
// the report, and so does a newer generation.
TEST(Membership, ASuspectIsExpelledOnlyWhenItsOwnPingsSayItNeverReachedTheCollective) {
  const auto t = Clock::now();
  using Progress = Membership::Progress;
  Membership m = formed(3);           // generation 0: slots 0, 1, 2
  m.heard_from(1, t, Progress{0, 9}); // slot 1 is in all_reduce #9 already
  EXPECT_EQ(m.reported_silent(0, 0, 9, {1, 2}, "all_reduce #9 (sum)"), (std::vector<int>{2}));
  EXPECT_FALSE(m.slot(1).held.has_value());

  EXPECT_FALSE(m.heard_from(2, t, Progress{0, 8}).has_value()); // maybe sent before the report
  const auto held = m.heard_from(2, t, Progress{0, 8});         // sent after it: still behind
  ASSERT_TRUE(held.has_value());
  EXPECT_EQ(held->reporter, 0);
  EXPECT_EQ(held->description, "all_reduce #9 (sum)");
  EXPECT_FALSE(m.slot(2).held.has_value());

  // Late, but there: a ping saying it started #9 (or later) clears it for good.
  Membership late = formed(3);
  EXPECT_EQ(late.reported_silent(0, 0, 9, {2}, "x"), (std::vector<int>{2}));
  EXPECT_FALSE(late.heard_from(2, t, Progress{0, 8}).has_value());
  EXPECT_FALSE(late.heard_from(2, t, Progress{0, 10}).has_value());
  EXPECT_FALSE(late.slot(2).held.has_value());
  EXPECT_FALSE(late.heard_from(2, t, Progress{0, 10}).has_value());

  // Behind in an older generation's numbers is behind.
  Membership old = formed(3);
  old.release(0, "was killed", false); // generation 1: slots [1, 2] as ranks 0, 1
  EXPECT_EQ(old.reported_silent(1, 1, 3, {1}, "x"), (std::vector<int>{2}));
  EXPECT_FALSE(old.heard_from(2, t, Progress{0, 50}).has_value());
  EXPECT_TRUE(old.heard_from(2, t, Progress{0, 50}).has_value());

  // A generation formed since the report: it is about a group that no longer exists.
  Membership moved = formed(3);
  EXPECT_EQ(moved.reported_silent(0, 0, 9, {2}, "x"), (std::vector<int>{2}));
  moved.release(1, "was killed", false);
  EXPECT_FALSE(moved.heard_from(2, t, Progress{0, 1}).has_value());
  EXPECT_FALSE(moved.heard_from(2, t, Progress{0, 1}).has_value());
}

// A partition between members that all reach the rendezvous: each reports whom its probe could
// not reach; once all have reported (or the window passed), the members outside the largest set
// that reach each other are the ones to expel; of equal sets, the one with the lowest slots.
TEST(Membership, APartitionExpelsTheSmallerSideOnceEveryMemberReported) {
  const auto t0 = Clock::now();
  const auto window = std::chrono::seconds(2);
  Membership m = formed(5);
  m.release(4, "was killed", false); // generation 1: slots [0, 1, 2, 3] as ranks 0..3
  // {0, 1, 2} | {3}: slot 3 reaches nobody, nobody reaches it.
  m.reported_unreachable(0, 1, {3}, t0);
  m.reported_unreachable(3, 1, {0, 1, 2}, t0);
  m.reported_unreachable(1, 1, {3}, t0);
  EXPECT_TRUE(m.partitioned(t0, window).empty()); // slot 2 has not reported yet
  m.reported_unreachable(1, 1, {0, 2}, t0);       // a second report is ignored
  m.reported_unreachable(2, 1, {3}, t0);
  EXPECT_EQ(m.partitioned(t0, window), (std::vector<int>{3}));
  EXPECT_TRUE(m.partitioned(t0, window).empty()); // decided once per generation
}

TEST(Membership, APartitionIsDecidedAfterTheWindowWithTheReportsThereAre) {
  const auto t0 = Clock::now();
  const auto window = std::chrono::seconds(2);
  Membership m = formed(4);
  // {0, 1} | {2, 3}, reported by slots 1 and 2 only: equal sides, the chief's (slot 0) stays.
  m.reported_unreachable(1, 0, {2, 3}, t0);
  m.reported_unreachable(2, 0, {0, 1}, t0 + std::chrono::milliseconds(100));
  EXPECT_TRUE(m.partitioned(t0 + std::chrono::milliseconds(1999), window).empty());
  EXPECT_EQ(m.partitioned(t0 + window, window), (std::vector<int>{2, 3}));
}

TEST(Membership, ProbesThatReachedEveryoneOrCameLateExpelNobody) {
  const auto t0 = Clock::now();
  Membership m = formed(3);
  for (int s = 0; s < 3; ++s) m.reported_unreachable(s, 0, {}, t0);
  EXPECT_TRUE(m.partitioned(t0, std::chrono::seconds(2)).empty()); // everyone reached everyone
  Membership late = formed(3);
  late.release(2, "was killed", false);        // generation 1
  late.reported_unreachable(0, 0, {1}, t0);    // about generation 0: stale
  late.reported_unreachable(2, 1, {0}, t0);    // from a slot that is no member
  late.reported_unreachable(0, 1, {0, 7}, t0); // itself, and a rank it does not have
  late.reported_unreachable(1, 1, {}, t0);
  EXPECT_TRUE(late.partitioned(t0, std::chrono::seconds(2)).empty());
  // A new generation starts with no reports.
  Membership again = formed(3);
  again.reported_unreachable(0, 0, {2}, t0);
  again.release(1, "was killed", false); // generation 1: slots [0, 2]
  EXPECT_TRUE(again.partitioned(t0 + std::chrono::seconds(5), std::chrono::seconds(2)).empty());
}

// Not a clean cut: slot 0 lost slots 1 and 2, which still reach each other and slot 3. The
// largest set that all reach each other is {1, 2, 3}.
TEST(Membership, OfACrookedPartitionTheLargestSetThatReachesItselfStays) {
  const auto t0 = Clock::now();
  Membership m = formed(4);
  m.reported_unreachable(0, 0, {1, 2}, t0);
  for (int s = 1; s < 4; ++s) m.reported_unreachable(s, 0, {}, t0);
  EXPECT_EQ(m.partitioned(t0, std::chrono::seconds(2)), (std::vector<int>{0}));
}

TEST(Membership, AFixedGroupKeepsEachRanksFirstFailureAndNeverFailsOneThatLeft) {
  Membership m(3, /*elastic=*/false, [](int s) { return "worker " + std::to_string(s); });
  for (int s = 0; s < 3; ++s) {
    EXPECT_TRUE(m.claim(s, session_of(s), "h").formed.empty()); // no generations
    m.start_heartbeat(s, Clock::now());
  }
  EXPECT_FALSE(m.formed());
  m.fail(1, "stopped sending heartbeats");
  m.fail(1, "lost its connection");
  m.leave(2);
  m.fail(2, "lost its connection");
  const auto failures = m.failures();
  ASSERT_EQ(failures.size(), 1u);
  EXPECT_EQ(failures[0].first, 1);
  EXPECT_EQ(failures[0].second, "worker 1 stopped sending heartbeats");
  // Neither the failed nor the departed rank is silent any more.
  EXPECT_TRUE(m.silent(Clock::now() + std::chrono::hours(1), std::chrono::seconds(1)) ==
              std::vector<int>{0});
}

} // namespace
} // namespace flotilla::collective::detail
