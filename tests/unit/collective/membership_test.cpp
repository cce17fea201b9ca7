// The rendezvous's membership rules without sockets: each transition of slots and generations,
// and what it reports for the server to record.
#include "collective/membership.h"

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
  EXPECT_EQ(waiting.info,
            (std::vector<std::string>{"worker 2 (back) is waiting to be admitted at the next step"}));
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
  m.release(1, "was stopped", false);                        // generation 1: [0]
  m.claim(1, session_of(3), "again");                        // waiting for a step boundary
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
