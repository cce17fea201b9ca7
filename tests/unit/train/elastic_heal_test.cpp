// Where the members of a new elastic generation go on (train/elastic_heal.h): every way a
// collective can have completed on some members and not on others, and the plan each gives.
#include "train/elastic_heal.h"

#include <gtest/gtest.h>

#include "flotilla/error.h"

using namespace flotilla;
using namespace flotilla::train::detail;

namespace {

FitPosition steps(std::int64_t epoch, std::int64_t step) {
  return {true, epoch, EpochStage::kSteps, step};
}
FitPosition at_end(std::int64_t epoch, EpochStage stage, std::int64_t step = 10) {
  return {true, epoch, stage, step};
}
FitPosition joiner() {
  FitPosition p;
  p.holds_state = false;
  return p;
}

} // namespace

TEST(ElasticHeal, MembersAtTheSamePlaceSendNothing) {
  for (const auto& p : {steps(1, 7), at_end(1, EpochStage::kGathered),
                        at_end(2, EpochStage::kEnded)}) {
    const HealPlan plan = plan_heal({p, p, p});
    EXPECT_EQ(plan.donor, 0);
    EXPECT_EQ(plan.target, p);
    EXPECT_FALSE(plan.send_state);
    EXPECT_FALSE(plan.send_epoch_end);
  }
}

TEST(ElasticHeal, AStepThatCompletedOnSomeMembersRollsTheOthersForward) {
  // Rank 2 applied step 8's update; ranks 0 and 1 did not get the all-reduce's result.
  const HealPlan plan = plan_heal({steps(0, 7), steps(0, 7), steps(0, 8)});
  EXPECT_EQ(plan.donor, 2);
  EXPECT_EQ(plan.target, steps(0, 8));
  EXPECT_TRUE(plan.send_state);
  EXPECT_FALSE(plan.send_epoch_end);
  // The lowest-ranked of those ahead gives.
  EXPECT_EQ(plan_heal({steps(0, 3), steps(0, 4), steps(0, 4)}).donor, 1);
}

TEST(ElasticHeal, AMemberBehindOnTheEpochsGatherTakesTheLogsOnly) {
  // Rank 0 still waits for the epoch's gather, which rank 1 completed.
  const HealPlan plan = plan_heal({at_end(0, EpochStage::kSteps), at_end(0, EpochStage::kGathered)});
  EXPECT_EQ(plan.donor, 1);
  EXPECT_FALSE(plan.send_state);
  EXPECT_TRUE(plan.send_epoch_end);
}

TEST(ElasticHeal, AMemberBehindOnTheMirroredBuffersTakesTheStateToo) {
  const HealPlan plan =
      plan_heal({at_end(3, EpochStage::kMirrored), at_end(3, EpochStage::kGathered)});
  EXPECT_EQ(plan.donor, 0);
  EXPECT_TRUE(plan.send_state);
  EXPECT_TRUE(plan.send_epoch_end);
  // Behind on validation: the record carries it; the buffers are the same already.
  const HealPlan later =
      plan_heal({at_end(3, EpochStage::kMirrored), at_end(3, EpochStage::kValidated)});
  EXPECT_EQ(later.donor, 1);
  EXPECT_FALSE(later.send_state);
  EXPECT_TRUE(later.send_epoch_end);
}

TEST(ElasticHeal, AMemberInTheStopVoteWhileAnotherBeganTheNextEpochGoesOnWithoutATransfer) {
  const HealPlan plan = plan_heal({at_end(4, EpochStage::kEnded), steps(5, 0)});
  EXPECT_EQ(plan.donor, 1);
  EXPECT_EQ(plan.target, steps(5, 0));
  EXPECT_FALSE(plan.send_state);
  EXPECT_FALSE(plan.send_epoch_end);
}

TEST(ElasticHeal, AMemberInTheStopVoteWhileAnotherLeftTheFitTakesTheVotesAnswer) {
  // Rank 1 completed the last epoch's vote and is in an evaluate() after fit.
  const HealPlan plan =
      plan_heal({at_end(6, EpochStage::kEnded), at_end(6, EpochStage::kAgreed)});
  EXPECT_EQ(plan.donor, 1);
  EXPECT_FALSE(plan.send_state);
  EXPECT_TRUE(plan.send_epoch_end); // the record carries the vote's answer
}

TEST(ElasticHeal, AJoinerTakesTheStateOfTheMostAdvancedMember) {
  const HealPlan plan = plan_heal({steps(2, 5), joiner(), steps(2, 6)});
  EXPECT_EQ(plan.donor, 2);
  EXPECT_TRUE(plan.send_state);
  EXPECT_FALSE(plan.nothing_to_join);
  // Only joiners: nobody holds anything.
  EXPECT_TRUE(plan_heal({joiner(), joiner()}).nothing_to_join);
}

// Where each member goes (what the healer applies), for the plans above.
TEST(ElasticHeal, AMemberBehindInTheStepsGoesOnFromTheTargetsStep) {
  const FitPosition behind = steps(1, 7);
  const Destination d = destination(plan_heal({behind, steps(1, 8)}), behind, false);
  EXPECT_TRUE(d.take_step);
  EXPECT_EQ(d.stage, EpochStage::kSteps);
  EXPECT_FALSE(d.stop.has_value());
  EXPECT_TRUE(d.same_epoch);
}

TEST(ElasticHeal, AMemberBehindInTheEpochsEndGoesOnFromTheTargetsStageNotItsSteps) {
  const FitPosition behind = at_end(1, EpochStage::kGathered);
  const Destination d =
      destination(plan_heal({behind, at_end(1, EpochStage::kMirrored)}), behind, true);
  EXPECT_FALSE(d.take_step);
  EXPECT_EQ(d.stage, EpochStage::kMirrored);
  EXPECT_FALSE(d.stop.has_value()); // the vote is still to come: nothing recorded is used
  EXPECT_TRUE(d.same_epoch);
}

TEST(ElasticHeal, AMemberThatMissedTheStopVoteTakesTheRecordedAnswer) {
  const FitPosition voting = at_end(6, EpochStage::kEnded);
  const HealPlan plan = plan_heal({voting, at_end(6, EpochStage::kAgreed)});
  EXPECT_EQ(destination(plan, voting, true).stop, std::optional<bool>(true));
  EXPECT_EQ(destination(plan, voting, false).stop, std::optional<bool>(false));
  EXPECT_EQ(destination(plan, voting, true).stage, EpochStage::kAgreed);
  // The member that voted keeps its own answer.
  EXPECT_FALSE(destination(plan, at_end(6, EpochStage::kAgreed), true).stop.has_value());
}

TEST(ElasticHeal, AMemberInTheStopVoteWhileOthersBeganTheNextEpochGoesOnFromItsOwnInput) {
  const FitPosition voting = at_end(4, EpochStage::kEnded);
  const Destination d = destination(plan_heal({voting, steps(5, 0)}), voting, true);
  EXPECT_FALSE(d.same_epoch);
  EXPECT_EQ(d.stop, std::optional<bool>(false)); // the vote said go on, whatever was recorded
  EXPECT_EQ(d.stage, EpochStage::kAgreed);
  EXPECT_FALSE(d.take_step);
}

TEST(ElasticHeal, PositionsNoCollectiveCanExplainAreAnErrorNotARegroup) {
  // A joiner at an epoch's end; a member before its epoch's callbacks while another began the
  // next epoch; one in the stop vote while another is steps into the next epoch; two epochs.
  for (const auto& members :
       std::vector<std::vector<FitPosition>>{{joiner(), at_end(1, EpochStage::kGathered)},
                                             {at_end(1, EpochStage::kValidated), steps(2, 0)},
                                             {at_end(1, EpochStage::kEnded), steps(2, 3)},
                                             {steps(1, 4), steps(3, 4)}}) {
    try {
      plan_heal(members);
      ADD_FAILURE() << "no error for " << members[0].describe() << " / " << members[1].describe();
    } catch (const CommError&) {
      ADD_FAILURE() << "a CommError would make the members regroup again";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("further apart than one collective"), std::string::npos)
          << e.what();
    }
  }
}

TEST(ElasticHeal, PositionsAndRecordsSurviveTheirEncoding) {
  std::int64_t raw[FitPosition::kFields];
  const FitPosition p = at_end(6, EpochStage::kValidated, 468);
  p.encode(raw);
  EXPECT_EQ(FitPosition::decode(raw), p);
  joiner().encode(raw);
  EXPECT_FALSE(FitPosition::decode(raw).holds_state);

  EpochEndRecord record;
  record.sums = {12.5, 0.1 + 0.2, 1e-300, 468.0};
  flotilla::train::PhaseTimes t;
  t.seconds[2] = 1.0 / 3;
  t.step_seconds = 2.5;
  t.comm_seconds = 0.25;
  t.steps = 468;
  record.phases = {t, flotilla::train::PhaseTimes{}};
  record.validation = {{"loss", 0.4321}, {"accuracy", 0.875}};
  record.stop = true;
  const EpochEndRecord back = EpochEndRecord::decode(record.encode(), "test");
  EXPECT_EQ(back.sums, record.sums); // exactly: the members' logs must not differ
  ASSERT_EQ(back.phases.size(), 2u);
  EXPECT_EQ(back.phases[0].seconds[2], 1.0 / 3);
  EXPECT_EQ(back.phases[0].steps, 468);
  EXPECT_EQ(back.validation, record.validation);
  EXPECT_TRUE(back.stop);
  EXPECT_THROW(EpochEndRecord::decode("{\"sums\": [1]}", "rank 2's record"), CommError);
}
