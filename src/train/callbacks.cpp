#include "flotilla/train/callbacks.h"

#include <ATen/CPUGeneratorImpl.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <mutex>
#include <nlohmann/json.hpp>
#include <set>

#include "flotilla/checkpoint/checkpoint_manager.h"
#include "flotilla/checkpoint/model_checkpoint.h"
#include "flotilla/error.h"
#include "flotilla/train/event_file.h"
#include "flotilla/train/progress.h"

namespace flotilla::train {
namespace fs = std::filesystem;
using nlohmann::json;

Model& Callback::model() const {
  if (!model_) throw ConfigError("a callback was used outside Model::fit()");
  return *model_;
}

bool Callback::is_chief() const { return model().strategy().is_chief(); }

// ---------------------------------------------------------------------------------------------
// ProgressBar

struct ProgressBar::Impl {
  Progress progress;
};

ProgressBar::ProgressBar(Verbosity verbose, std::FILE* out) : verbose_(verbose), out_(out) {}
ProgressBar::~ProgressBar() = default;

void ProgressBar::on_train_begin() {
  Verbosity verbose = verbose_;
  if (verbose == Verbosity::kAuto) verbose = params().verbose;
  if (verbose == Verbosity::kAuto) {
    verbose = ::isatty(fileno(out_)) ? Verbosity::kProgressBar : Verbosity::kOneLinePerEpoch;
  }
  impl_ = std::make_unique<Impl>(Impl{Progress(is_chief() && verbose != Verbosity::kSilent,
                                               verbose == Verbosity::kProgressBar, out_)});
}

void ProgressBar::on_epoch_begin(int epoch) {
  impl_->progress.begin_epoch(epoch + 1, params().epochs, params().steps);
}

void ProgressBar::on_train_batch_end(std::int64_t batch, const Logs& logs) {
  impl_->progress.step(batch + 1, logs);
}

void ProgressBar::on_epoch_end(int epoch, EpochLogs& logs) { impl_->progress.end_epoch(logs); }

// ---------------------------------------------------------------------------------------------
// Monitoring a logs key (ModelCheckpoint, EarlyStopping)

namespace {

bool maximizes(MonitorMode mode, const std::string& monitor) {
  if (mode != MonitorMode::kAuto) return mode == MonitorMode::kMax;
  // Keras's rule: accuracies and AUC improve upward, everything else downward.
  return monitor.find("acc") != std::string::npos || monitor.find("auc") != std::string::npos;
}

bool improved(double value, std::optional<double> best, bool maximize, double min_delta = 0) {
  if (!best) return true;
  return maximize ? value - min_delta > *best : value + min_delta < *best;
}

// The state a fit needs to continue, as the manifest's "state" object.
json state_to_json(const TrainingState& s) {
  json j = {{"iterations", s.iterations},
            {"epoch", s.epoch},
            {"step_in_epoch", s.step_in_epoch},
            {"loss_scale", s.loss_scale},
            {"loss_scale_good_steps", s.loss_scale_good_steps}};
  if (s.iterator) {
    j["iterator"] = {{"iteration", s.iterator->iteration},
                     {"produced", s.iterator->produced},
                     {"fingerprint", s.iterator->fingerprint}};
  }
  return j;
}

TrainingState state_from_json(const json& j, const fs::path& where) {
  try {
    TrainingState s;
    s.iterations = j.at("iterations").get<std::int64_t>();
    s.epoch = j.at("epoch").get<int>();
    s.step_in_epoch = j.at("step_in_epoch").get<std::int64_t>();
    s.loss_scale = j.at("loss_scale").get<double>();
    s.loss_scale_good_steps = j.at("loss_scale_good_steps").get<std::int64_t>();
    if (j.contains("iterator")) {
      const json& it = j.at("iterator");
      s.iterator = data::IteratorState{it.at("iteration").get<std::int64_t>(),
                                       it.at("produced").get<std::int64_t>(),
                                       it.at("fingerprint").get<std::string>()};
    }
    return s;
  } catch (const json::exception& e) {
    throw CheckpointError(where.string() + ": the training state in its manifest is incomplete (" +
                          e.what() + "); it was not written by this version of flotilla's fit");
  }
}

std::string to_hex(const torch::Tensor& bytes) {
  static const char* digits = "0123456789abcdef";
  const torch::Tensor b = bytes.contiguous().to(torch::kUInt8);
  const auto* p = b.data_ptr<std::uint8_t>();
  std::string out;
  out.reserve(static_cast<std::size_t>(b.numel()) * 2);
  for (std::int64_t i = 0; i < b.numel(); ++i) {
    out += digits[p[i] >> 4];
    out += digits[p[i] & 15];
  }
  return out;
}

torch::Tensor from_hex(const std::string& hex) {
  torch::Tensor out = torch::empty({static_cast<std::int64_t>(hex.size() / 2)}, torch::kUInt8);
  auto* p = out.data_ptr<std::uint8_t>();
  auto nibble = [](char c) {
    return static_cast<std::uint8_t>(c <= '9' ? c - '0' : c - 'a' + 10);
  };
  for (std::size_t i = 0; i + 1 < hex.size(); i += 2) {
    p[i / 2] = static_cast<std::uint8_t>(nibble(hex[i]) << 4 | nibble(hex[i + 1]));
  }
  return out;
}

// Everything a checkpoint directory holds for `model`.
checkpoint::CheckpointData capture(Model& model) {
  checkpoint::CheckpointData data;
  data.model = checkpoint::model_state(model.module());
  data.optimizer = checkpoint::optimizer_state(model.optimizer());
  const TrainingState state = model.training_state();
  data.epoch = state.epoch;
  data.step = state.iterations;
  data.policy = to_string(model.policy());
  data.state = state_to_json(state);
  // The CPU generator: dropout masks and other draws continue as if never interrupted.
  data.state["rng_cpu"] = to_hex(at::detail::getDefaultCPUGenerator().get_state());
  return data;
}

// Weights, optimizer state and RNG into `model`; returns the training state to resume.
TrainingState apply(Model& model, const checkpoint::CheckpointData& data, const fs::path& where) {
  checkpoint::load_model_state(model.module(), data.model);
  // Every replica's optimizer: fit() re-syncs the replicas' weights, not their optimizer state.
  for (auto* optimizer : model.optimizers()) {
    checkpoint::load_optimizer_state(*optimizer, data.optimizer);
  }
  if (data.state.contains("rng_cpu")) {
    at::Generator generator = at::detail::getDefaultCPUGenerator();
    generator.set_state(
        from_hex(data.state.at("rng_cpu").get<std::string>()));
  }
  return state_from_json(data.state, where);
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
    const bool ok = spec.empty() || (spec.find_first_not_of("0123456789.dfeg") ==
                                         std::string::npos &&
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
                      "updates; saw " + std::to_string(options_.save_freq));
  }
  if (options_.save_best_only && options_.save_freq > 0) {
    // Batch logs are each worker's own running means: workers could disagree on "best" and so
    // on whether to take part in the (collective) save.
    throw ConfigError("ModelCheckpoint: save_best_only compares epoch logs, which are global; "
                      "with save_freq " + std::to_string(options_.save_freq) +
                      " it would compare each worker's own batch logs. Use save_freq 0");
  }
  if (options_.save_weights_only && fs::path(options_.filepath).extension() != ".safetensors") {
    throw ConfigError("ModelCheckpoint with save_weights_only writes safetensors: end filepath "
                      "with .safetensors; saw \"" + options_.filepath + "\"");
  }
}

void ModelCheckpoint::on_train_begin() {
  last_saved_iteration_ = model().iterations();
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
  if (options_.save_weights_only) {
    checkpoint::save_model(strategy.communicator(), model().module(), path.parent_path().empty() ? "." :
                                                           path.parent_path(),
                           path.filename().string(),
                           {{"epoch", std::to_string(epoch_1based)}, {"format", "flotilla"}});
  } else {
    checkpoint::CheckpointManager manager(path, options_.max_to_keep);
    const std::int64_t number =
        options_.save_freq == 0 ? epoch_1based : model().iterations();
    saved_.push_back(manager.save(strategy.communicator(), strategy.log(), capture(model()), number));
    return;
  }
  saved_.push_back(path);
}

void ModelCheckpoint::on_train_batch_end(std::int64_t batch, const Logs& logs) {
  if (options_.save_freq == 0) return;
  const std::int64_t iterations = model().iterations();
  if (iterations - last_saved_iteration_ < options_.save_freq) return;
  last_saved_iteration_ = iterations;
  save(model().current_epoch() + 1, logs);
}

void ModelCheckpoint::on_epoch_end(int epoch, EpochLogs& logs) {
  if (options_.save_freq == 0) save(epoch + 1, logs.values);
}

// ---------------------------------------------------------------------------------------------
// Preemption

namespace {

// Votes at least this often (in steps), however fast the steps: a request must not wait for
// a count of steps a run may never reach.
constexpr std::int64_t kMaxVoteEvery = 1000;

// Process-wide because a signal is: the SIGTERM handler can reach nothing else. Lock-free, so
// setting it from the handler is async-signal-safe.
std::atomic<bool> g_preemption_requested{false};
static_assert(std::atomic<bool>::is_always_lock_free);

extern "C" void on_sigterm(int) { g_preemption_requested.store(true); }

// Fits in one process (ranks as threads, or a user's own threads) share the one SIGTERM
// disposition: the first to start installs the handler, the last to end puts back what was
// there before.
std::mutex g_handler_mutex;
int g_handler_users = 0;
struct sigaction g_previous_sigterm {};

void acquire_sigterm_handler() {
  std::lock_guard<std::mutex> lock(g_handler_mutex);
  if (g_handler_users++ > 0) return;
  struct sigaction action {};
  action.sa_handler = on_sigterm;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESTART; // a collective's socket calls carry on; the flag waits for them
  ::sigaction(SIGTERM, &action, &g_previous_sigterm);
}

void release_sigterm_handler() {
  std::lock_guard<std::mutex> lock(g_handler_mutex);
  if (--g_handler_users == 0) ::sigaction(SIGTERM, &g_previous_sigterm, nullptr);
}

} // namespace

void request_preemption() noexcept { g_preemption_requested.store(true); }

bool preemption_requested() noexcept { return g_preemption_requested.load(); }

// ---------------------------------------------------------------------------------------------
// BackupAndRestore

BackupAndRestore::BackupAndRestore(BackupOptions options) : options_(std::move(options)) {
  if (options_.backup_dir.empty()) throw ConfigError("BackupAndRestore needs a backup_dir");
  if (options_.save_freq < 0) {
    throw ConfigError("BackupAndRestore save_freq must be 0 (every epoch) or a number of "
                      "updates; saw " + std::to_string(options_.save_freq));
  }
}

BackupAndRestore::~BackupAndRestore() {
  // A fit that ended by an exception other than Preempted has a vote still in flight.
  if (vote_) {
    try {
      vote_->wait();
    } catch (const std::exception&) {
      // The fit failed already; its own error is the one that matters.
    }
  }
  release_signal_handler();
}

void BackupAndRestore::release_signal_handler() {
  if (!handler_installed_) return;
  handler_installed_ = false;
  release_sigterm_handler();
}

void BackupAndRestore::start_vote(std::int64_t steps_timed) {
  const bool mine = requested_.load() || g_preemption_requested.load();
  // The chief proposes the steps until the next vote from its own step time; the others send
  // 0, so the MAX hands every worker the chief's number.
  std::int64_t every = 0;
  const auto now = std::chrono::steady_clock::now();
  if (is_chief()) {
    every = 1;
    const auto target = options_.preemption_check_interval;
    if (target.count() > 0 && steps_timed > 0) {
      const double step_s =
          std::chrono::duration<double>(now - vote_started_).count() / steps_timed;
      const double steps = std::chrono::duration<double>(target).count() / std::max(step_s, 1e-6);
      every = std::clamp<std::int64_t>(static_cast<std::int64_t>(steps), 1, kMaxVoteEvery);
    }
  }
  vote_started_ = now;
  vote_tensor_ = torch::tensor({std::int64_t{mine ? 1 : 0}, every}, torch::kInt64);
  vote_ = model().strategy().communicator().all_reduce(vote_tensor_, strategy::ReduceOp::kMax);
}

bool BackupAndRestore::finish_vote() {
  if (!vote_) return false;
  vote_->wait();
  vote_.reset();
  vote_every_ = std::max<std::int64_t>(1, vote_tensor_[1].item<std::int64_t>());
  return vote_tensor_[0].item<std::int64_t>() != 0;
}

void BackupAndRestore::on_train_begin() {
  restored_.reset();
  std::vector<std::string> skipped;
  fs::path from;
  const auto data = checkpoint::restore_latest(options_.backup_dir, &skipped, &from);
  auto& strategy = model().strategy();
  if (strategy.is_chief()) {
    for (const auto& reason : skipped) strategy.log().warn("BackupAndRestore: " + reason);
  }
  // Every worker must resume from the same backup, or none: agree before touching the model.
  const std::int64_t mine = data ? data->step : -1;
  const torch::Tensor range = strategy.reduce(strategy::ReduceOp::kMin,
                                              torch::tensor({mine, -mine}, torch::kInt64));
  if (range[0].item<std::int64_t>() != -range[1].item<std::int64_t>()) {
    throw CheckpointError("BackupAndRestore: the workers see different backups in " +
                          options_.backup_dir.string() +
                          " (or some see none); backup_dir must be storage every worker shares");
  }
  number_ = 0;
  last_backup_iteration_ = model().iterations();
  agreed_ = false;
  vote_.reset();
  vote_every_ = 1;
  since_vote_ = 0;
  if (data) {
    const TrainingState state = apply(model(), *data, from);
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
  if (options_.handle_preemption && !handler_installed_) {
    acquire_sigterm_handler();
    handler_installed_ = true;
  }
}

void BackupAndRestore::backup() {
  checkpoint::CheckpointData data = capture(model());
  data.state["backup_number"] = ++number_;
  checkpoint::CheckpointManager manager(options_.backup_dir, /*max_to_keep=*/2, "backup");
  manager.save(model().strategy().communicator(), model().strategy().log(), data, number_);
  last_backup_iteration_ = data.step;
}

void BackupAndRestore::on_train_batch_end(std::int64_t batch, const Logs& logs) {
  if (options_.handle_preemption) {
    // The last vote, read now: it had at least a whole step to complete behind the computation;
    // the next starts at once. Both happen every vote_every_ steps (the same on every worker).
    if (!agreed_ && ++since_vote_ >= vote_every_) {
      since_vote_ = 0;
      // The chief times the steps since the vote being read began, for its next proposal.
      const std::int64_t steps_timed = vote_ ? vote_every_ : 0;
      agreed_ = finish_vote();
      if (!agreed_) start_vote(steps_timed);
    }
    if (agreed_) {
      // Stop only where a resume continues exactly: after an optimizer update (not inside an
      // accumulation group), and not at an epoch's last step (a backup there would resume into
      // an exhausted pass, which ends the fit); the epoch's end is a backup of its own.
      const int accumulation = model().compile_options().gradient_accumulation_steps;
      const bool in_group = (batch + 1) % accumulation != 0;
      const bool epoch_last = params().steps > 0 && batch + 1 >= params().steps;
      if (!in_group && !epoch_last) {
        backup();
        const TrainingState state = model().training_state();
        requested_ = false;
        g_preemption_requested.store(false); // acted on; a new fit in this process starts clean
        release_signal_handler();
        throw Preempted("training preempted (a worker received SIGTERM or "
                        "request_preemption()): every worker saved the backup at update " +
                            std::to_string(state.iterations) + " (epoch " +
                            std::to_string(state.epoch + 1) + ", step " +
                            std::to_string(state.step_in_epoch) + ") in " +
                            options_.backup_dir.string() +
                            "; start the same job again to resume from there",
                        state.iterations);
      }
    }
  }
  if (options_.save_freq == 0) return;
  // Not at an epoch's last step either: resumed there, the pass is exhausted and fit would end
  // without the epoch's end (its checkpoint, its logs, the epochs after it). The epoch-end
  // backup comes right after this step anyway.
  const bool epoch_last = params().steps > 0 && batch + 1 >= params().steps;
  if (!epoch_last && model().iterations() - last_backup_iteration_ >= options_.save_freq) {
    backup();
  }
}

void BackupAndRestore::on_epoch_end(int epoch, EpochLogs& logs) { backup(); }

void BackupAndRestore::on_train_end() {
  // A request this late finds the work done: nothing is left to resume, so the fit ends as
  // usual (and the process goes on to what follows it).
  const bool late = finish_vote() || agreed_;
  if (late && is_chief()) {
    model().strategy().log().info("BackupAndRestore: preemption was requested at the last step; "
                                  "training had finished, so it ends normally");
  }
  if (late) g_preemption_requested.store(false);
  agreed_ = false;
  requested_ = false;
  release_signal_handler();
  // Only a fit that ran to its end removes the backup (one that stopped early was asked to).
  if (!options_.delete_checkpoint) return;
  auto& strategy = model().strategy();
  strategy.reduce(strategy::ReduceOp::kSum, torch::zeros({1})); // nobody still reads it
  if (strategy.is_chief()) {
    std::error_code ec;
    fs::remove_all(options_.backup_dir, ec);
    if (ec) {
      strategy.log().warn("BackupAndRestore: could not remove " + options_.backup_dir.string() +
                          " (" + ec.message() + "); remove it before the next run");
    }
  }
}

// ---------------------------------------------------------------------------------------------
// TensorBoard

struct TensorBoard::Writers {
  explicit Writers(const fs::path& log_dir)
      : train(log_dir / "train"), validation(log_dir / "validation") {}
  EventFileWriter train;
  EventFileWriter validation;
};

TensorBoard::TensorBoard(TensorBoardOptions options) : options_(std::move(options)) {
  if (options_.log_dir.empty()) throw ConfigError("TensorBoard needs a log_dir");
  if (options_.update_freq < 0) {
    throw ConfigError("TensorBoard update_freq must be 0 (per epoch) or a number of updates; "
                      "saw " + std::to_string(options_.update_freq));
  }
}

TensorBoard::~TensorBoard() = default;

void TensorBoard::on_train_begin() {
  if (!is_chief()) return;
  writers_ = std::make_unique<Writers>(options_.log_dir);
}

void TensorBoard::on_train_batch_end(std::int64_t batch, const Logs& logs) {
  if (!writers_ || options_.update_freq == 0) return;
  const std::int64_t step = model().iterations();
  if (step % options_.update_freq != 0) return;
  for (const auto& [key, value] : logs.items()) writers_->train.scalar("batch_" + key, value, step);
  writers_->train.flush();
}

void TensorBoard::on_epoch_end(int epoch, EpochLogs& logs) {
  if (!writers_) return;
  for (const auto& [key, value] : logs.values.items()) {
    if (key.rfind("val_", 0) == 0) {
      writers_->validation.scalar("epoch_" + key.substr(4), value, epoch);
    } else {
      writers_->train.scalar("epoch_" + key, value, epoch);
    }
  }
  writers_->train.scalar("epoch_samples_per_s", logs.samples_per_s, epoch);
  writers_->train.flush();
  writers_->validation.flush();
}

void TensorBoard::on_train_end() { writers_.reset(); }

// ---------------------------------------------------------------------------------------------
// EarlyStopping

EarlyStopping::EarlyStopping(EarlyStoppingOptions options) : options_(std::move(options)) {
  if (options_.patience < 0) {
    throw ConfigError("EarlyStopping patience must be at least 0; saw " +
                      std::to_string(options_.patience));
  }
  options_.min_delta = std::fabs(options_.min_delta);
}

void EarlyStopping::on_train_begin() {
  best_ = options_.baseline;
  wait_ = 0;
  stopped_epoch_.reset();
  best_epoch_ = 0;
  best_weights_.clear();
}

void EarlyStopping::on_epoch_end(int epoch, EpochLogs& logs) {
  const auto value = logs.values.get(options_.monitor);
  if (!value || epoch < options_.start_from_epoch) {
    if (!value && is_chief()) {
      model().strategy().log().warn("EarlyStopping: monitor \"" + options_.monitor +
                                    "\" is not in the logs; it cannot stop training");
    }
    return;
  }
  const bool maximize = maximizes(options_.mode, options_.monitor);
  ++wait_;
  if (improved(*value, best_, maximize, options_.min_delta)) {
    best_ = *value;
    best_epoch_ = epoch;
    wait_ = 0;
    if (options_.restore_best_weights) {
      torch::NoGradGuard no_grad;
      best_weights_.clear();
      for (const auto& p : model().module().parameters()) best_weights_.push_back(p.clone());
      for (const auto& b : model().module().buffers()) best_weights_.push_back(b.clone());
    }
    return;
  }
  if (wait_ >= options_.patience && epoch > 0) {
    stopped_epoch_ = epoch;
    model().stop_training = true;
  }
}

void EarlyStopping::on_train_end() {
  if (!stopped_epoch_) return;
  if (is_chief()) {
    model().strategy().log().info("Epoch " + std::to_string(*stopped_epoch_ + 1) +
                                  ": early stopping (best " + options_.monitor + " at epoch " +
                                  std::to_string(best_epoch_ + 1) + ")");
  }
  if (options_.restore_best_weights && !best_weights_.empty()) {
    torch::NoGradGuard no_grad;
    std::size_t k = 0;
    for (auto& p : model().module().parameters()) p.copy_(best_weights_[k++]);
    for (auto& b : model().module().buffers()) b.copy_(best_weights_[k++]);
  }
}

// ---------------------------------------------------------------------------------------------
// CSVLogger

CSVLogger::CSVLogger(fs::path filename, char separator, bool append)
    : filename_(std::move(filename)), separator_(separator), append_(append) {}

void CSVLogger::on_train_begin() {
  keys_.clear();
  if (!is_chief()) return;
  // Found before training, not after an epoch of it.
  std::ofstream probe(filename_, append_ ? std::ios::app : std::ios::trunc);
  if (!probe) {
    throw ConfigError("CSVLogger cannot write " + filename_.string() +
                      "; check that its directory exists and is writable");
  }
}

void CSVLogger::on_epoch_end(int epoch, EpochLogs& logs) {
  if (!is_chief()) return;
  std::ofstream out(filename_, std::ios::app);
  if (keys_.empty()) {
    std::set<std::string> sorted;
    for (const auto& [key, value] : logs.values.items()) sorted.insert(key);
    keys_.assign(sorted.begin(), sorted.end());
    // A file being appended to has its header already.
    if (!append_ || fs::file_size(filename_) == 0) {
      out << "epoch";
      for (const auto& key : keys_) out << separator_ << key;
      out << "\n";
    }
  }
  out << epoch;
  char buf[64];
  for (const auto& key : keys_) {
    const auto value = logs.values.get(key);
    if (value) {
      std::snprintf(buf, sizeof buf, "%.17g", *value);
      out << separator_ << buf;
    } else {
      out << separator_ << "NA";
    }
  }
  out << "\n";
  if (!out.flush()) {
    throw ConfigError("CSVLogger could not write to " + filename_.string() + "; is the disk full?");
  }
}

// ---------------------------------------------------------------------------------------------
// TerminateOnNaN and LearningRateScheduler

void TerminateOnNaN::on_train_batch_end(std::int64_t batch, const Logs& logs) {
  if (model().last_step_finite()) return;
  if (is_chief()) {
    model().strategy().log().warn("Batch " + std::to_string(batch) +
                                  ": non-finite gradients (invalid loss), terminating training");
  }
  model().stop_training = true;
}

void TerminateOnNaN::on_epoch_end(int epoch, EpochLogs& logs) {
  if (std::isfinite(logs.values.at("loss"))) return;
  if (is_chief()) {
    model().strategy().log().warn("Epoch " + std::to_string(epoch + 1) +
                                  ": invalid loss, terminating training");
  }
  model().stop_training = true;
}

LearningRateScheduler::LearningRateScheduler(std::function<double(int, double)> schedule)
    : schedule_(std::move(schedule)) {
  if (!schedule_) throw ConfigError("LearningRateScheduler needs a schedule function");
}

void LearningRateScheduler::on_epoch_begin(int epoch) {
  model().set_learning_rate(schedule_(epoch, model().learning_rate()));
}

} // namespace flotilla::train
