// Keras's logging callbacks, chief only: TensorBoard event files and a CSV row per epoch.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "flotilla/train/callback.h"

namespace flotilla::train {

struct TensorBoardOptions {
  std::filesystem::path log_dir;
  std::int64_t update_freq = 0; // 0: per epoch; N: also batch_* scalars every N updates
};

// Keras's TensorBoard: event files under log_dir/train and log_dir/validation with
// epoch_<key> scalars (loss, metrics, learning_rate, samples_per_s) at each epoch; chief only.
// In an elastic fit also epoch_generation: the generation that decided the epoch's last update
// (Model::generation), so that a replaced chief's late lines can be told from its successor's.
class TensorBoard : public Callback {
 public:
  explicit TensorBoard(TensorBoardOptions options);
  ~TensorBoard() override;
  void on_train_begin() override;
  void on_train_batch_end(std::int64_t batch, const Logs& logs) override;
  void on_epoch_end(int epoch, EpochLogs& logs) override;
  void on_train_end() override;
  CallbackNeeds needs() const override;

 private:
  struct Writers;
  TensorBoardOptions options_;
  std::unique_ptr<Writers> writers_;
};

// Keras's CSVLogger: "epoch" (0-based) then the logs' keys, sorted; chief only. In an elastic
// fit a "generation" column follows "epoch" (as TensorBoard's epoch_generation).
class CSVLogger : public Callback {
 public:
  explicit CSVLogger(std::filesystem::path filename, char separator = ',', bool append = false);
  void on_train_begin() override;
  void on_epoch_end(int epoch, EpochLogs& logs) override;
  CallbackNeeds needs() const override;

 private:
  std::filesystem::path filename_;
  char separator_;
  bool append_;
  std::vector<std::string> keys_;
};

} // namespace flotilla::train
