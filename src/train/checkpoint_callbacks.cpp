#include "flotilla/train/checkpoint_callbacks.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>

#include "flotilla/base/system.h"
#include "flotilla/checkpoint/checkpoint_manager.h"
#include "flotilla/checkpoint/directory.h"
#include "flotilla/checkpoint/model_checkpoint.h"
#include "flotilla/collective/agreement.h"
#include "flotilla/collective/elastic.h"
#include "flotilla/error.h"
#include "flotilla/strategy/strategy.h"
#include "train/monitor.h"

namespace flotilla::train {
namespace fs = std::filesystem;
namespace {

// False, with the chief's warning, when the model's weights hold non-finite values (the
// training diverged): no checkpoint of them is written, so the newest stays the last finite one.
// Every worker sees the same weights (mirrored), so all skip together.
bool finite_or_warn(Model& model, const std::string& who) {
  const std::string bad = checkpoint::first_non_finite(checkpoint::model_state(model.module()));
  if (bad.empty()) return true;
  if (model.strategy().is_chief()) {
    model.strategy().log().warn(who + ": not saving: the model's " + bad +
                                " holds non-finite values (the training diverged); the newest "
                                "checkpoint stays the last one with finite weights");
  }
  return false;
}

// The number in the name of the newest checkpoint the pointer names (0 without one): a chief
// that took over mid-fit goes on from its predecessor's numbering.
std::int64_t newest_number(const checkpoint::CheckpointManager& manager) {
  const auto latest = manager.latest();
  if (!latest) return 0;
  const std::string name = latest->filename().string();
  const std::string head = manager.prefix() + "-";
  if (name.rfind(head, 0) != 0) return 0;
  try {
    return std::stoll(name.substr(head.size()));
  } catch (const std::exception&) {
    return 0;
  }
}

} // namespace

// ---------------------------------------------------------------------------------------------
// ModelCheckpoint

std::string format_filepath(const std::string& pattern, int epoch, const Logs& logs) {
  std::string out;
  for (std::size_t i = 0; i < pattern.size(); ++i) {
    if (pattern[i] != '{') {
      out += pattern[i];
      continue;
    }
    const std::size_t close = pattern.find('}', i);
    if (close == std::string::npos) {
      throw ConfigError("filepath \"" + pattern + "\" has a '{' without its '}'");
    }
    const std::string field = pattern.substr(i + 1, close - i - 1);
    const std::size_t colon = field.find(':');
    const std::string key = field.substr(0, colon);
    const std::string spec = colon == std::string::npos ? "" : field.substr(colon + 1);
    const bool is_epoch = key == "epoch";
    double value = 0;
    if (is_epoch) {
      value = epoch;
    } else if (auto v = logs.get(key)) {
      value = *v;
    } else {
      throw ConfigError("filepath \"" + pattern + "\" names {" + key +
                        "}, which is not in the logs; use {epoch} or a logged key (" +
                        (logs.empty() ? std::string("none yet") : logs.items().front().first) +
                        ", ...)");
    }
    // A Python format spec's common forms: [0][width](d|f|e|g) with an optional .precision.
    const bool ok =
        spec.empty() || (spec.find_first_not_of("0123456789.dfeg") == std::string::npos &&
                         std::string("dfeg").find(spec.back()) != std::string::npos);
    if (!ok) {
      throw ConfigError("filepath \"" + pattern + "\": format \"" + spec +
                        "\" is not supported; use forms like 02d, .4f, e or g");
    }
    char buf[64];
    if (spec.empty()) {
      if (is_epoch) {
        std::snprintf(buf, sizeof buf, "%d", epoch);
      } else {
        std::snprintf(buf, sizeof buf, "%g", value);
      }
    } else if (spec.back() == 'd') {
      std::snprintf(buf, sizeof buf, ("%" + spec.substr(0, spec.size() - 1) + "lld").c_str(),
                    static_cast<long long>(std::llround(value)));
    } else {
      std::snprintf(buf, sizeof buf, ("%" + spec).c_str(), value);
    }
    out += buf;
    i = close;
  }
  return out;
}

ModelCheckpoint::ModelCheckpoint(ModelCheckpointOptions options) : options_(std::move(options)) {
  if (options_.filepath.empty()) throw ConfigError("ModelCheckpoint needs a filepath");
  if (options_.save_freq < 0) {
    throw ConfigError("ModelCheckpoint save_freq must be 0 (every epoch) or a number of "
                      "updates; saw " +
                      std::to_string(options_.save_freq));
  }
  if (options_.save_best_only && options_.save_freq > 0) {
    // Batch logs are each worker's own running means: workers could disagree on "best" and so
    // on whether to take part in the (collective) save.
    throw ConfigError("ModelCheckpoint: save_best_only compares epoch logs, which are global; "
                      "with save_freq " +
                      std::to_string(options_.save_freq) +
                      " it would compare each worker's own batch logs. Use save_freq 0");
  }
  if (options_.save_weights_only && fs::path(options_.filepath).extension() != ".safetensors") {
    throw ConfigError("ModelCheckpoint with save_weights_only writes safetensors: end filepath "
                      "with .safetensors; saw \"" +
                      options_.filepath + "\"");
  }
}

void ModelCheckpoint::on_train_begin() {
  cadence_.restart(model().iterations(), model().strategy().joining());
}

void ModelCheckpoint::save(int epoch_1based, const Logs& logs) {
  if (options_.save_best_only) {
    const auto value = logs.get(options_.monitor);
    if (!value) {
      if (is_chief()) {
        model().strategy().log().warn("ModelCheckpoint: can save best model only with " +
                                      options_.monitor + " available; skipping");
      }
      return;
    }
    if (!improved(*value, best_, maximizes(options_.mode, options_.monitor))) return;
    best_ = *value;
  }
  const fs::path path = format_filepath(options_.filepath, epoch_1based, logs);
  auto& strategy = model().strategy();
  collective::Communicator* const group = strategy.saving_group();
  if (!group) return;
  if (!finite_or_warn(model(), "ModelCheckpoint")) return;
  if (options_.save_weights_only) {
    // Every worker saves together (the buffers' mirror is a collective). Elastic: the chief alone,
    // with the buffers it has (mirrored at each epoch's end).
    if (strategy.saves_collectively()) model().mirror_buffers();
    std::optional<checkpoint::WeightsFence> fence;
    if (strategy.elastic()) {
      fence = checkpoint::WeightsFence{model().training_id(), model().generation(),
                                       model().iterations()};
    }
    checkpoint::save_model(
        *group, model().module(), path.parent_path().empty() ? "." : path.parent_path(),
        path.filename().string(), {{"epoch", std::to_string(epoch_1based)}, {"format", "flotilla"}},
        fence);
  } else {
    checkpoint::CheckpointManager manager(path, options_.max_to_keep);
    const std::int64_t number = options_.save_freq == 0 ? epoch_1based : model().iterations();
    checkpoint::CheckpointData data = checkpoint_data(model());
    data.generation = model().generation(); // -1 (unfenced) outside elastic fits
    saved_.push_back(manager.save(*group, strategy.log(), data, number));
    return;
  }
  saved_.push_back(path);
}

void ModelCheckpoint::on_train_batch_end(std::int64_t batch, const Logs& logs) {
  if (options_.save_freq == 0) return;
  const std::int64_t iterations = model().iterations();
  if (!cadence_.due(iterations, options_.save_freq)) return;
  cadence_.saved(iterations);
  save(model().current_epoch() + 1, logs);
}

void ModelCheckpoint::on_epoch_end(int epoch, EpochLogs& logs) {
  if (options_.save_freq == 0) save(epoch + 1, logs.values);
}

CallbackNeeds ModelCheckpoint::needs() const {
  // The part of filepath no template changes: "run/ckpt" (a directory of checkpoints) as it is,
  // "run/ckpt-{epoch}" and "run/weights.safetensors" their directory.
  fs::path fixed = options_.filepath;
  const std::size_t brace = options_.filepath.find('{');
  if (brace != std::string::npos)
    fixed = fs::path(options_.filepath.substr(0, brace)).parent_path();
  if (options_.save_weights_only && brace == std::string::npos) fixed = fixed.parent_path();
  CallbackNeeds needs;
  needs.directories.push_back(
      {"ModelCheckpointOptions::filepath", fixed.empty() ? fs::path(".") : fixed});
  return needs;
}

// ---------------------------------------------------------------------------------------------
// BackupAndRestore

BackupAndRestore::BackupAndRestore(BackupOptions options) : options_(std::move(options)) {
  if (options_.backup_dir.empty()) throw ConfigError("BackupAndRestore needs a backup_dir");
  if (options_.save_freq < 0) {
    throw ConfigError("BackupAndRestore save_freq must be 0 (every epoch) or a number of "
                      "updates; saw " +
                      std::to_string(options_.save_freq));
  }
}

void BackupAndRestore::on_train_begin() {
  restored_.reset();
  if (requested_.exchange(false)) model().request_preemption();
  number_ = 0;
  claimed_ = false;
  if (model().strategy().joining()) {
    // Joining an elastic group mid-fit: the state comes from a live peer, not from here, and
    // the others are past this agreement. Backups are counted from this worker's first step.
    cadence_.restart(0, /*joining=*/true);
    return;
  }
  auto& strategy = model().strategy();
  // The chief looks; every worker stops on what it found, so none waits for the others.
  const std::string refusal = collective::broadcast_string(
      strategy.communicator(), strategy.is_chief() ? claim_directory() : std::string(), 0);
  if (!refusal.empty()) throw ConfigError(refusal);
  const std::optional<TrainingState> state = restore();
  cadence_.restart(state ? state->iterations : model().iterations(), /*joining=*/false);
  if (state) {
    model().restore_training_state(*state);
    restored_ = state;
    // A resume at or past the fit's last epoch (a preempted job restarted with fewer --epochs,
    // say) trains nothing; its backups are all there is of that training, so they stay.
    if (nothing_left() && strategy.is_chief()) {
      strategy.log().warn(
          "BackupAndRestore: the backup in " + options_.backup_dir.string() + " has " +
          std::to_string(state->epoch) + " epoch(s) done (" + std::to_string(state->iterations) +
          " updates), and this fit asks for " + std::to_string(params().epochs) +
          ": nothing is left to train, and the backups are kept. Ask for more epochs to go on "
          "from it, or move the directory away to start afresh");
    }
  }
}

namespace {

std::string host_name() {
  char name[256] = {};
  if (::gethostname(name, sizeof name - 1) != 0) return "?";
  return name;
}

// "host h, process p, since t, training <model> (<n> parameters, seed s, w workers)"
std::string describe_holder(const nlohmann::json& holder) {
  if (!holder.is_object() || !holder.contains("pid")) {
    return "a process that has not written its name into the lock file yet";
  }
  std::string text = "the process " + holder.value("pid", nlohmann::json()).dump() + " on " +
                     holder.value("host", std::string("?")) + ", since " +
                     holder.value("started", std::string("?"));
  const nlohmann::json run = holder.value("run", nlohmann::json::object());
  if (run.is_object() && run.contains("model")) {
    text += ", training " + run.value("model", std::string("?")) + " (" +
            run.value("parameter_count", nlohmann::json()).dump() + " parameters, seed " +
            run.value("seed", nlohmann::json()).dump() + ", " +
            run.value("workers", nlohmann::json()).dump() + " workers)";
  }
  return text;
}

std::string start_afresh(const fs::path& dir) {
  return "To start afresh, move it away (mv " + dir.string() + " " + dir.string() +
         ".old) or give BackupOptions::backup_dir another directory";
}

} // namespace

std::string BackupAndRestore::claim_directory(bool elastic_takeover) {
  const fs::path& dir = options_.backup_dir;
  std::error_code ec;
  const bool existed = fs::exists(fs::symlink_status(dir, ec));
  if (existed && !fs::is_directory(dir, ec)) {
    return "BackupOptions::backup_dir " + dir.string() +
           " exists and is not a directory; give a directory of its own";
  }
  if (!existed) {
    fs::create_directories(dir, ec);
    if (ec) {
      return "BackupOptions::backup_dir " + dir.string() + " cannot be made (" + ec.message() +
             "); give a writable directory";
    }
  }
  if (!elastic_takeover) {
    std::vector<std::string> ours = {checkpoint::kLockFile};
    const fs::path here = fs::weakly_canonical(dir, ec);
    for (const auto& output : options_.own_outputs) {
      std::error_code ignored;
      const fs::path path = fs::weakly_canonical(output, ignored);
      if (!ignored && !here.empty() && path.parent_path() == here) {
        ours.push_back(path.filename().string());
      }
    }
    const auto foreign = checkpoint::foreign_entries(dir, "backup", ours);
    if (!foreign.empty()) {
      std::string names;
      for (std::size_t i = 0; i < foreign.size() && i < 5; ++i) {
        names += (i ? ", " : "") + foreign[i];
      }
      if (foreign.size() > 5) names += ", ... (" + std::to_string(foreign.size()) + " in all)";
      return "BackupOptions::backup_dir " + dir.string() + " holds what flotilla did not write (" +
             names +
             "); BackupAndRestore deletes its backups when the fit completes, so it needs a "
             "directory of its own: give a new or empty one";
    }
  }
  // Made by an earlier fit of this directory's jobs: deleted again at the end, as then.
  const auto previous = checkpoint::DirectoryLock::record(dir);
  const bool created = !existed || (previous && previous->value("created_directory", false));
  const nlohmann::json record = {{"holder", "flotilla BackupAndRestore"},
                                 {"host", host_name()},
                                 {"pid", ::getpid()},
                                 {"started", base::utc_now()},
                                 {"run", run_identity(model())},
                                 {"created_directory", created}};
  nlohmann::json holder;
  try {
    // A fit after a preempted one, with the same callback: its lock is still held.
    if (!lock_.held()) lock_ = checkpoint::DirectoryLock::try_acquire(dir, record, holder);
  } catch (const std::exception& e) {
    return "BackupAndRestore: " + std::string(e.what());
  }
  claimed_ = true;
  if (lock_.held()) return "";
  // This very process (ranks as threads, or an earlier fit's callback still alive) is not
  // another job.
  if (holder.value("pid", -1) == ::getpid() && holder.value("host", "") == host_name()) return "";
  if (elastic_takeover) {
    model().strategy().log().warn("BackupAndRestore: " + dir.string() + " is still locked by " +
                                  describe_holder(holder) +
                                  ", the group's chief before this one (frozen or cut off); "
                                  "going on without the lock");
    return "";
  }
  claimed_ = false;
  return "BackupOptions::backup_dir " + dir.string() +
         " is in use by another job: " + describe_holder(holder) +
         ". Two jobs on one backup directory would resume from and overwrite each other's "
         "backups: give this job a directory of its own, or wait for that one to end";
}

std::optional<TrainingState> BackupAndRestore::restore() {
  auto& strategy = model().strategy();
  const fs::path& dir = options_.backup_dir;
  const nlohmann::json identity = run_identity(model());
  std::vector<std::string> skipped;
  fs::path from;
  std::optional<TrainingState> state;
  // The newest backup that verifies and loads; one of another model stops the search (its
  // parameters cannot take this model's place, and an older one is no better).
  const auto data = checkpoint::restore_latest(
      dir, &skipped, &from,
      [&](const checkpoint::CheckpointData& data, const fs::path& path) {
        const nlohmann::json run = data.state.value("run", nlohmann::json::object());
        if (run.is_object() && run.contains("parameters") &&
            run["parameters"] != identity["parameters"]) {
          throw ConfigError(
              "BackupAndRestore: " + path.string() +
              " is a backup of another model: " + run.value("model", std::string("?")) + " with " +
              run.value("parameter_count", nlohmann::json()).dump() +
              " parameters, where this fit trains " + identity["model"].get<std::string>() +
              " with " + identity["parameter_count"].dump() +
              " (their parameters' names and shapes differ). " + start_afresh(dir));
        }
        state = load_checkpoint_data(model(), data, path);
        // This run's backups must fence out the run that wrote this one, whose generations
        // were counted by another rendezvous from 0 too: its tokens start above this one's.
        const std::int64_t generation =
            strategy.elastic() ? static_cast<std::int64_t>(strategy.elastic()->generation()) : 0;
        state->generation_base =
            std::max<std::int64_t>(state->generation_base, data.generation + 1 - generation);
      },
      strategy.communicator().options().checkpoint_key);
  if (strategy.is_chief()) {
    for (const auto& reason : skipped) strategy.log().warn("BackupAndRestore: " + reason);
  }
  // Backups that none of could be resumed from are not overwritten with a fresh start's.
  bool any_backup = false;
  if (!data) {
    std::error_code ec;
    for (const auto& entry : fs::directory_iterator(dir, ec)) {
      const std::string name = entry.path().filename().string();
      any_backup = any_backup || (name.rfind("backup-", 0) == 0 &&
                                  fs::exists(entry.path() / checkpoint::kManifestFile, ec));
    }
  }
  // Every worker must resume from the same backup, or none: agree before training.
  const std::int64_t outcome = data ? data->step : (any_backup ? -2 : -1);
  if (!collective::same_value(strategy.communicator(), outcome)) {
    throw CheckpointError("BackupAndRestore: the workers see different backups in " + dir.string() +
                          " (or some see none); backup_dir must be storage every worker shares");
  }
  if (any_backup) {
    throw ConfigError("BackupAndRestore: " + dir.string() +
                      " holds backups, but none verifies and loads (the reasons are above); "
                      "they are left as they are. " +
                      start_afresh(dir));
  }
  if (data) {
    number_ = data->state.value("backup_number", std::int64_t{0});
    if (strategy.is_chief()) {
      strategy.log().info("BackupAndRestore: resuming from " + from.string() + " at epoch " +
                          std::to_string(state->epoch + 1) + ", step " +
                          std::to_string(state->step_in_epoch) + " (" +
                          std::to_string(state->iterations) + " updates done)");
    }
  }
  return state;
}

CallbackNeeds BackupAndRestore::needs() const {
  CallbackNeeds needs;
  if (options_.handle_preemption) needs.preemption_check = options_.preemption_check_interval;
  needs.directories.push_back({"BackupOptions::backup_dir", options_.backup_dir, true});
  return needs;
}

void BackupAndRestore::request_preemption() noexcept {
  if (Model* model = model_or_null()) {
    model->request_preemption();
  } else {
    requested_ = true; // passed on when its fit begins
  }
}

bool BackupAndRestore::backup() {
  auto& strategy = model().strategy();
  cadence_.saved(model().iterations());
  collective::Communicator* const group = strategy.saving_group();
  if (!group) return false;
  // A member that became the elastic group's chief mid-fit takes its predecessor's lock.
  if (strategy.elastic() && !claimed_) {
    const std::string refusal = claim_directory(/*elastic_takeover=*/true);
    if (!refusal.empty()) throw ConfigError(refusal);
  }
  if (!finite_or_warn(model(), "BackupAndRestore")) return true; // the last finite one stays
  checkpoint::CheckpointManager manager(options_.backup_dir, /*max_to_keep=*/2, "backup");
  if (strategy.elastic()) number_ = std::max(number_, newest_number(manager));
  checkpoint::CheckpointData data = checkpoint_data(model());
  data.state["backup_number"] = ++number_;
  // The fencing token: the generation that decided this state, counted over the training's runs.
  data.generation = strategy.elastic() ? model().generation()
                                       : data.state.value("generation_base", std::int64_t{0});
  manager.save(*group, strategy.log(), data, number_);
  return true;
}

std::string BackupAndRestore::on_preemption() {
  return backup() ? options_.backup_dir.string() : std::string();
}

void BackupAndRestore::on_train_batch_end(std::int64_t batch, const Logs& logs) {
  if (options_.save_freq == 0) return;
  // Not at an epoch's last step: resumed there, the pass is exhausted and fit would end without
  // the epoch's end (its checkpoint, its logs, the epochs after it). The epoch-end backup comes
  // right after this step anyway. (params().steps is at most the epoch's steps: see
  // EpochIterator::known_steps.)
  const bool epoch_last = params().steps > 0 && batch + 1 >= params().steps;
  if (!epoch_last && cadence_.due(model().iterations(), options_.save_freq)) {
    backup();
  }
}

void BackupAndRestore::on_epoch_end(int epoch, EpochLogs& logs) {
  backup();
}

void BackupAndRestore::on_train_end() {
  // Only a fit that ran to its end deletes the backups (one that stopped early was asked to),
  // and only when it trained: one that found nothing left keeps them, and so does one that
  // diverged (its last finite backup is where a run with a lower rate goes on from).
  const bool diverged =
      !checkpoint::first_non_finite(checkpoint::model_state(model().module())).empty();
  if (!options_.delete_checkpoint || nothing_left() || diverged) {
    lock_ = {};
    return;
  }
  auto& strategy = model().strategy();
  // Nobody still reads it. (Elastic: no collective after the fit's last agreement, which the
  // group could not heal; every member restored, or joined without reading, long before.)
  if (strategy.saves_collectively()) strategy.communicator().barrier().wait();
  if (!strategy.is_chief()) return;
  const fs::path& dir = options_.backup_dir;
  const auto record = checkpoint::DirectoryLock::record(dir);
  std::vector<std::string> problems = checkpoint::remove_checkpoints(dir, "backup");
  if (lock_.held()) {
    lock_.release_and_remove();
  } else {
    std::error_code ignored;
    fs::remove(dir / checkpoint::kLockFile, ignored);
  }
  lock_ = {};
  claimed_ = false;
  // The directory itself only when flotilla made it, and only when nothing else is in it.
  std::error_code ec;
  if (record && record->value("created_directory", false) && fs::is_empty(dir, ec)) {
    fs::remove(dir, ec);
  }
  for (const auto& problem : problems) {
    strategy.log().warn("BackupAndRestore: " + problem);
  }
}

} // namespace flotilla::train
