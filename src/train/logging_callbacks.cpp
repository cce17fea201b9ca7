#include "flotilla/train/logging_callbacks.h"

#include <fstream>
#include <set>

#include "flotilla/error.h"
#include "flotilla/train/event_file.h"

namespace flotilla::train {
namespace fs = std::filesystem;

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
                      "saw " +
                      std::to_string(options_.update_freq));
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
  // In an elastic group the chief can change mid-fit (the lowest surviving worker): the new one
  // opens its own event files beside the old chief's, which TensorBoard reads together.
  if (!writers_ && is_chief()) writers_ = std::make_unique<Writers>(options_.log_dir);
  if (writers_ && !is_chief()) writers_.reset(); // a restarted slot 0 leads again
  if (!writers_) return;
  for (const auto& [key, value] : logs.values.items()) {
    if (key.rfind("val_", 0) == 0) {
      writers_->validation.scalar("epoch_" + key.substr(4), value, epoch);
    } else {
      writers_->train.scalar("epoch_" + key, value, epoch);
    }
  }
  writers_->train.scalar("epoch_samples_per_s", logs.samples_per_s, epoch);
  // Elastic: the generation that decided the epoch's last update (its fencing token), so that a
  // replaced chief's late lines can be told from its successor's.
  const std::int64_t generation = model().generation();
  if (generation >= 0) {
    writers_->train.scalar("epoch_generation", static_cast<double>(generation), epoch);
  }
  writers_->train.flush();
  writers_->validation.flush();
}

void TensorBoard::on_train_end() {
  writers_.reset();
}

// ---------------------------------------------------------------------------------------------
// CSVLogger

CSVLogger::CSVLogger(fs::path filename, char separator, bool append)
    : filename_(std::move(filename)), separator_(separator), append_(append) {}

void CSVLogger::on_train_begin() {
  keys_.clear();
  if (!is_chief()) return;
  // Found before training, not after an epoch of it. A worker joining a running elastic fit (a
  // restarted slot 0 leads again) continues the file: truncating it lost the rows before.
  const bool fresh = !append_ && !model().strategy().joining();
  std::ofstream probe(filename_, fresh ? std::ios::trunc : std::ios::app);
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
    // A file being appended to has its header already: appended, continued by a joiner, or
    // by a successor that became the chief mid-fit.
    if (fs::file_size(filename_) == 0) {
      out << "epoch";
      if (model().generation() >= 0) out << separator_ << "generation";
      for (const auto& key : keys_) out << separator_ << key;
      out << "\n";
    }
  }
  out << epoch;
  // Elastic: the generation that decided the epoch's last update (see TensorBoard's).
  if (const std::int64_t generation = model().generation(); generation >= 0) {
    out << separator_ << generation;
  }
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

CallbackNeeds TensorBoard::needs() const {
  CallbackNeeds needs;
  needs.directories.push_back({"TensorBoardOptions::log_dir", options_.log_dir});
  return needs;
}

CallbackNeeds CSVLogger::needs() const {
  CallbackNeeds needs;
  const auto parent = filename_.parent_path();
  needs.directories.push_back({"CSVLogger's file", parent.empty() ? "." : parent});
  return needs;
}

} // namespace flotilla::train
