#include "train/elastic_heal.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <tuple>

#include "flotilla/error.h"

namespace flotilla::train::detail {

namespace {
const char* stage_name(EpochStage stage) {
  switch (stage) {
  case EpochStage::kSteps: return "steps";
  case EpochStage::kGathered: return "logs gathered";
  case EpochStage::kMirrored: return "buffers mirrored";
  case EpochStage::kValidated: return "validated";
  case EpochStage::kEnded: return "callbacks done";
  case EpochStage::kAgreed: return "stop agreed";
  }
  return "?";
}
} // namespace

void FitPosition::encode(std::int64_t* out) const {
  out[0] = holds_state ? 1 : 0;
  out[1] = epoch;
  out[2] = static_cast<std::int64_t>(stage);
  out[3] = step;
}

FitPosition FitPosition::decode(const std::int64_t* in) {
  FitPosition p;
  p.holds_state = in[0] != 0;
  p.epoch = in[1];
  p.stage = static_cast<EpochStage>(std::clamp<std::int64_t>(in[2], 0, 5));
  p.step = in[3];
  return p;
}

std::string FitPosition::describe() const {
  if (!holds_state) return "joining";
  const std::string e = "epoch " + std::to_string(epoch + 1);
  if (stage == EpochStage::kSteps) return e + ", " + std::to_string(step) + " steps done";
  return e + "'s end, " + stage_name(stage);
}

bool operator<(const FitPosition& a, const FitPosition& b) {
  return std::make_tuple(a.epoch, static_cast<std::int64_t>(a.stage), a.step) <
         std::make_tuple(b.epoch, static_cast<std::int64_t>(b.stage), b.step);
}

bool operator==(const FitPosition& a, const FitPosition& b) {
  return a.holds_state == b.holds_state && !(a < b) && !(b < a);
}

HealPlan plan_heal(const std::vector<FitPosition>& members) {
  HealPlan plan;
  int donor = -1;
  for (std::size_t r = 0; r < members.size(); ++r) {
    if (!members[r].holds_state) continue;
    if (donor < 0 || members[static_cast<std::size_t>(donor)] < members[r]) {
      donor = static_cast<int>(r);
    }
  }
  if (donor < 0) {
    plan.nothing_to_join = true;
    return plan;
  }
  plan.donor = donor;
  const FitPosition& t = members[static_cast<std::size_t>(donor)];
  plan.target = t;
  const auto too_far = [&](const FitPosition& m, std::size_t r) {
    return Error("elastic: after a change of membership, rank " + std::to_string(r) +
                 " stands at " + m.describe() + " and rank " + std::to_string(donor) + " at " +
                 t.describe() +
                 ", further apart than one collective; the group cannot agree where to go on");
  };
  for (std::size_t r = 0; r < members.size(); ++r) {
    const FitPosition& m = members[r];
    if (!m.holds_state) {
      // Admitted at a step boundary, so the others are in their steps.
      if (t.stage != EpochStage::kSteps) throw too_far(m, r);
      plan.send_state = true;
      continue;
    }
    if (m == t) continue;
    if (m.epoch == t.epoch) {
      // A step behind (its update completed elsewhere), or behind within the epoch's end.
      if (m.stage == EpochStage::kSteps && m.step != t.step) plan.send_state = true;
      if (m.stage < EpochStage::kMirrored && t.stage >= EpochStage::kMirrored) {
        plan.send_state = true; // the buffers as the others mirrored them
      }
      if (t.stage > EpochStage::kSteps) plan.send_epoch_end = true;
      continue;
    }
    // Waiting in the stop vote while the donor, past it, began the next epoch: the vote said go
    // on, and nothing else happened in between.
    if (m.epoch + 1 == t.epoch && m.stage == EpochStage::kEnded && t.stage == EpochStage::kSteps) {
      if (t.step > 0) throw too_far(m, r);
      continue;
    }
    throw too_far(m, r);
  }
  return plan;
}

void flatten(const PhaseTimes& times, double* out) {
  std::copy(times.seconds.begin(), times.seconds.end(), out);
  out[kPhaseCount] = times.step_seconds;
  out[kPhaseCount + 1] = times.comm_seconds;
  out[kPhaseCount + 2] = static_cast<double>(times.steps);
}

PhaseTimes unflatten(const double* in) {
  PhaseTimes times;
  std::copy(in, in + kPhaseCount, times.seconds.begin());
  times.step_seconds = in[kPhaseCount];
  times.comm_seconds = in[kPhaseCount + 1];
  times.steps = static_cast<std::int64_t>(in[kPhaseCount + 2]);
  return times;
}

std::string EpochEndRecord::encode() const {
  nlohmann::json phases_json = nlohmann::json::array();
  for (const auto& p : phases) {
    std::vector<double> flat(kPhaseTimesFields);
    flatten(p, flat.data());
    phases_json.push_back(flat);
  }
  return nlohmann::json{
      {"sums", sums}, {"phases", phases_json}, {"validation", validation}, {"stop", stop}}
      .dump();
}

EpochEndRecord EpochEndRecord::decode(const std::string& text, const std::string& source) {
  try {
    const auto j = nlohmann::json::parse(text);
    EpochEndRecord record;
    record.sums = j.at("sums").get<std::vector<double>>();
    for (const auto& flat : j.at("phases")) {
      const auto values = flat.get<std::vector<double>>();
      if (values.size() != kPhaseTimesFields) throw CommError("a phase entry has the wrong length");
      record.phases.push_back(unflatten(values.data()));
    }
    record.validation =
        j.at("validation").get<std::vector<std::pair<std::string, double>>>();
    record.stop = j.at("stop").get<bool>();
    return record;
  } catch (const nlohmann::json::exception& e) {
    throw CommError(source + " is not an epoch's end record (" + e.what() + ")");
  }
}

Destination destination(const HealPlan& plan, const FitPosition& mine, bool recorded_stop) {
  const FitPosition& target = plan.target;
  Destination d;
  if (target.epoch != mine.epoch) {
    // This worker waited in the stop vote; the others, past it, began the next epoch: the vote
    // said go on.
    d.same_epoch = false;
    d.stop = false;
    d.stage = EpochStage::kAgreed;
    return d;
  }
  // The same epoch: its steps from the target's step on, or its end from the target's stage.
  d.take_step = target.stage == EpochStage::kSteps;
  d.stage = target.stage;
  if (target.stage == EpochStage::kAgreed && mine.stage < EpochStage::kAgreed) {
    d.stop = recorded_stop;
  }
  return d;
}

} // namespace flotilla::train::detail
