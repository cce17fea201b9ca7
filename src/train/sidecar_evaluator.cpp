#include "flotilla/train/sidecar_evaluator.h"

#include <cstdio>
#include <thread>

#include "flotilla/checkpoint/checkpoint_manager.h"
#include "flotilla/error.h"
#include "flotilla/train/event_file.h"

namespace flotilla::train {

namespace {

std::string seconds_text(std::chrono::milliseconds ms) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g s", static_cast<double>(ms.count()) / 1000.0);
  return buf;
}

// Puts the global policy back however the recompile ends.
class GlobalPolicyScope {
 public:
  explicit GlobalPolicyScope(Policy policy) : previous_(global_policy()) {
    set_global_policy(policy);
  }
  ~GlobalPolicyScope() { set_global_policy(previous_); }
  GlobalPolicyScope(const GlobalPolicyScope&) = delete;
  GlobalPolicyScope& operator=(const GlobalPolicyScope&) = delete;

 private:
  Policy previous_;
};

} // namespace

SidecarEvaluator::SidecarEvaluator(Model& model, data::Dataset data,
                                   SidecarEvaluatorOptions options)
    : model_(model), data_(std::move(data)), options_(std::move(options)) {
  if (options_.checkpoint_dir.empty()) {
    throw ConfigError("SidecarEvaluatorOptions::checkpoint_dir is empty; give the directory the "
                      "chief saves its checkpoints into (ModelCheckpointOptions::filepath)");
  }
  if (options_.poll_interval.count() <= 0) {
    throw ConfigError("SidecarEvaluatorOptions::poll_interval must be positive; saw " +
                      std::to_string(options_.poll_interval.count()) + " ms");
  }
  if (options_.max_evaluations && *options_.max_evaluations < 1) {
    throw ConfigError("SidecarEvaluatorOptions::max_evaluations must be at least 1 (or unset: no "
                      "limit); saw " +
                      std::to_string(*options_.max_evaluations));
  }
  model_.compile_options(); // ConfigError now, not at the first checkpoint, when not compiled
}

void SidecarEvaluator::use_policy(Policy policy) {
  if (model_.policy() == policy) return;
  // compile() reads the global policy, as in Keras; the model keeps its weights. A copy:
  // compile() replaces the options it is given a reference to.
  const CompileOptions options = model_.compile_options();
  const GlobalPolicyScope scope(policy);
  model_.compile(options);
}

std::vector<SidecarResult> SidecarEvaluator::start() {
  using Clock = std::chrono::steady_clock;
  const checkpoint::CheckpointManager manager(options_.checkpoint_dir);
  std::optional<EventFileWriter> events;
  if (!options_.log_dir.empty()) events.emplace(options_.log_dir);
  std::vector<SidecarResult> results;
  std::optional<std::filesystem::path> done;
  std::string refused; // why the last checkpoint that could not be read was refused
  auto last_new = Clock::now();
  while (true) {
    std::optional<std::filesystem::path> latest;
    try {
      latest = manager.latest();
    } catch (const CheckpointError&) {
      // The chief is replacing the pointer file: look again shortly.
    }
    std::optional<checkpoint::CheckpointData> saved;
    if (latest && latest != done) {
      try {
        saved = checkpoint::read_checkpoint(*latest);
      } catch (const CheckpointError& e) {
        // Deleted by max_to_keep between the pointer and the read, or not there yet on a
        // shared file system: the next look finds a newer one, or this one whole.
        refused = e.what();
      }
    }
    if (!saved) {
      if (Clock::now() - last_new > options_.timeout) {
        throw TimeoutError(
            "SidecarEvaluator: no new checkpoint in " + options_.checkpoint_dir.string() + " for " +
            seconds_text(options_.timeout) +
            " (SidecarEvaluatorOptions::timeout); is the chief running and saving there?" +
            (refused.empty() ? std::string() : " The last one refused: " + refused));
      }
      std::this_thread::sleep_for(options_.poll_interval);
      continue;
    }
    const Policy policy =
        options_.use_checkpoint_policy ? parse_policy(saved->policy) : model_.policy();
    use_policy(policy);
    checkpoint::load_model_state(model_.module(), saved->model, latest->string());
    SidecarResult r;
    r.checkpoint = *latest;
    r.epoch = saved->epoch;
    r.step = saved->step;
    r.policy = policy;
    r.result = model_.evaluate(data_);
    if (events) {
      for (const auto& [key, value] : r.result.values.items()) {
        events->scalar("epoch_" + key, value, r.epoch);
      }
      events->flush();
    }
    if (options_.on_result) options_.on_result(r);
    results.push_back(std::move(r));
    done = latest;
    refused.clear();
    last_new = Clock::now();
    const bool last_epoch_done = options_.last_epoch && saved->epoch >= *options_.last_epoch;
    const bool enough =
        options_.max_evaluations && static_cast<int>(results.size()) >= *options_.max_evaluations;
    if (last_epoch_done || enough) return results;
  }
}

} // namespace flotilla::train
