#include "flotilla/train/checkpoint_callbacks.h"

#include <algorithm>
#include <cmath>

#include "flotilla/checkpoint/checkpoint_manager.h"
#include "flotilla/checkpoint/model_checkpoint.h"
#include "flotilla/collective/agreement.h"
#include "flotilla/error.h"
#include "flotilla/strategy/strategy.h"
#include "train/monitor.h"

namespace flotilla::train {
namespace fs = std::filesystem;
namespace {

// The group a save goes through. Fixed membership: every worker (a collective save). Elastic:
// the chief alone, as a group of one, and nobody for the others, since a collective is one a
// worker joining or leaving mid-fit could not take part in.
collective::Communicator* saving_group(strategy::Strategy& strategy) {
  if (!strategy.elastic()) return &strategy.communicator();
  if (!strategy.is_chief()) return nullptr;
  static auto* const alone = new collective::Communicator( // never destroyed: used until exit
      collective::Communicator::local_group(1).front());
  return alone;
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
  // A worker joining an elastic group learns its updates only after this: counted from its
  // first step.
  last_saved_iteration_ = model().strategy().joining() ? -1 : model().iterations();
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
  collective::Communicator* const group = saving_group(strategy);
  if (!group) return;
  if (options_.save_weights_only) {
    // Every worker saves together (the buffers' mirror is a collective). Elastic: the chief alone,
    // with the buffers it has (mirrored at each epoch's end).
    if (!strategy.elastic()) model().mirror_buffers();
    checkpoint::save_model(*group, model().module(),
                           path.parent_path().empty() ? "." : path.parent_path(),
                           path.filename().string(),
                           {{"epoch", std::to_string(epoch_1based)}, {"format", "flotilla"}});
  } else {
    checkpoint::CheckpointManager manager(path, options_.max_to_keep);
    const std::int64_t number = options_.save_freq == 0 ? epoch_1based : model().iterations();
    saved_.push_back(manager.save(*group, strategy.log(), checkpoint_data(model()), number));
    return;
  }
  saved_.push_back(path);
}

void ModelCheckpoint::on_train_batch_end(std::int64_t batch, const Logs& logs) {
  if (options_.save_freq == 0) return;
  const std::int64_t iterations = model().iterations();
  if (last_saved_iteration_ < 0) last_saved_iteration_ = iterations - 1; // joined (above)
  if (iterations - last_saved_iteration_ < options_.save_freq) return;
  last_saved_iteration_ = iterations;
  save(model().current_epoch() + 1, logs);
}

void ModelCheckpoint::on_epoch_end(int epoch, EpochLogs& logs) {
  if (options_.save_freq == 0) save(epoch + 1, logs.values);
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
  if (model().strategy().joining()) {
    // Joining an elastic group mid-fit: the state comes from a live peer, not from here, and
    // the others are past this agreement. Backups are counted from this worker's first step.
    last_backup_iteration_ = -1;
    return;
  }
  std::vector<std::string> skipped;
  fs::path from;
  const auto data = checkpoint::restore_latest(options_.backup_dir, &skipped, &from);
  auto& strategy = model().strategy();
  if (strategy.is_chief()) {
    for (const auto& reason : skipped) strategy.log().warn("BackupAndRestore: " + reason);
  }
  // Every worker must resume from the same backup, or none: agree before touching the model.
  if (!collective::same_value(strategy.communicator(), data ? data->step : -1)) {
    throw CheckpointError("BackupAndRestore: the workers see different backups in " +
                          options_.backup_dir.string() +
                          " (or some see none); backup_dir must be storage every worker shares");
  }
  last_backup_iteration_ = model().iterations();
  if (data) {
    const TrainingState state = load_checkpoint_data(model(), *data, from);
    model().restore_training_state(state);
    restored_ = state;
    last_backup_iteration_ = state.iterations;
    number_ = data->state.value("backup_number", std::int64_t{0});
    if (strategy.is_chief()) {
      strategy.log().info("BackupAndRestore: resuming from " + from.string() + " at epoch " +
                          std::to_string(state.epoch + 1) + ", step " +
                          std::to_string(state.step_in_epoch) + " (" +
                          std::to_string(state.iterations) + " updates done)");
    }
  }
}

CallbackNeeds BackupAndRestore::needs() const {
  CallbackNeeds needs;
  if (options_.handle_preemption) needs.preemption_check = options_.preemption_check_interval;
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
  last_backup_iteration_ = model().iterations();
  collective::Communicator* const group = saving_group(strategy);
  if (!group) return false;
  checkpoint::CheckpointManager manager(options_.backup_dir, /*max_to_keep=*/2, "backup");
  if (strategy.elastic()) number_ = std::max(number_, newest_number(manager));
  checkpoint::CheckpointData data = checkpoint_data(model());
  data.state["backup_number"] = ++number_;
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
  if (last_backup_iteration_ < 0) last_backup_iteration_ = model().iterations() - 1; // joined
  if (!epoch_last && model().iterations() - last_backup_iteration_ >= options_.save_freq) {
    backup();
  }
}

void BackupAndRestore::on_epoch_end(int epoch, EpochLogs& logs) {
  backup();
}

void BackupAndRestore::on_train_end() {
  // Only a fit that ran to its end removes the backup (one that stopped early was asked to).
  if (!options_.delete_checkpoint) return;
  auto& strategy = model().strategy();
  // Nobody still reads it. (Elastic: no collective after the fit's last agreement, which the
  // group could not heal; every member restored, or joined without reading, long before.)
  if (!strategy.elastic()) strategy.communicator().barrier().wait();
  if (strategy.is_chief()) {
    std::error_code ec;
    fs::remove_all(options_.backup_dir, ec);
    if (ec) {
      strategy.log().warn("BackupAndRestore: could not remove " + options_.backup_dir.string() +
                          " (" + ec.message() + "); remove it before the next run");
    }
  }
}

} // namespace flotilla::train
