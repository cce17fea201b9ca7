// Where a fit stands, and the codec between it and a checkpoint: the state a resumed fit needs
// beyond weights (updates applied, epoch, step, the input's position, the loss scale) as the
// "state" object of a checkpoint's manifest, and a Model's whole training state as a
// checkpoint's data (weights, optimizer state, that state and the CPU generator) and back.
// ModelCheckpoint, BackupAndRestore and the SidecarEvaluator read and write checkpoints through
// these, so all agree on one format.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>

#include "flotilla/checkpoint/checkpoint_manager.h"
#include "flotilla/collective/communicator.h"
#include "flotilla/data/dataset.h"

namespace flotilla::train {

class Model;

// Where a fit stands, for checkpoints and BackupAndRestore.
struct TrainingState {
  std::int64_t iterations = 0; // optimizer updates applied (the schedules' step)
  // Rows in the global batches of those updates (the schedules' step, as iterations × the
  // global batch, in an elastic fit keeping the per-replica batch); -1: not recorded.
  std::int64_t trained_rows = -1;
  int epoch = 0;                  // epochs completed
  std::int64_t step_in_epoch = 0; // steps of the current epoch done (0 at an epoch boundary)
  std::optional<data::IteratorState> iterator; // the training input's position
  double loss_scale = 0;                       // 0: no loss scaling
  std::int64_t loss_scale_good_steps = 0;
  // Fencing (BackupAndRestore): what this run adds to its elastic generation to make the
  // backups' token, so that tokens grow over the runs of one training (each run's rendezvous
  // counts generations from 0). Set when a run resumes from a backup; a joiner gets it with the
  // rest of the state.
  std::int64_t generation_base = 0;
  // Fencing: which training this state belongs to, a random id the first run's chief draws
  // (elastic fits) and every later run, resume and joiner inherits. Storage fences a writer only
  // against checkpoints of its own training: a job started afresh replaces an earlier job's
  // files, as Keras's callbacks do, whatever generations they record. Empty: none drawn.
  std::string training;
};

// The manifest's "state" object, and back (CheckpointError naming `where` when incomplete).
nlohmann::json to_json(const TrainingState& state);
TrainingState training_state_from_json(const nlohmann::json& state,
                                       const std::filesystem::path& where);

// What a backup was written by: the module's name, a SHA-256 over its parameters' names and
// shapes (the part compared: a backup of another model cannot be resumed), the parameter count,
// torch's seed and the number of workers.
nlohmann::json run_identity(Model& model);

// Everything a checkpoint directory holds for `model`: weights, replica 0's optimizer state,
// the training state, the CPU generator's state (dropout masks and other draws continue as if
// never interrupted) and the run's identity ("run").
checkpoint::CheckpointData checkpoint_data(Model& model);
// Loads weights into the model, optimizer state into every replica's optimizer and the CPU
// generator's state; returns the training state for Model::restore_training_state.
TrainingState load_checkpoint_data(Model& model, const checkpoint::CheckpointData& data,
                                   const std::filesystem::path& where);

// Elastic healing: rank `donor`'s whole training state sent over the network to every other
// rank of `comm` and loaded there, as a worker that rejoins gets it from a live peer instead of
// from disk: the weights and buffers (the donor's own, not mirrored: that would be a
// collective), the optimizer state, the CPU generator, and `state` (updates, epoch, step, loss
// scale, the input's position), as one safetensors message. Collective: every rank calls it;
// `state` is read on the donor only. Returns the donor's `state` on every rank (pass it to
// Model::restore_training_state). CheckpointError when a receiver's model does not match.
TrainingState share_training_state(Model& model, collective::Communicator& comm, int donor,
                                   const TrainingState& state);

} // namespace flotilla::train
