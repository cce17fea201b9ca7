// Private: Keras's test and predict steps over a distributed dataset, on a compiled step's model
// (replica 0), across workers. Model::evaluate and Model::predict run them after mirroring the
// buffers, healed by the healer where the group is elastic.
#pragma once

#include <torch/nn/module.h>
#include <torch/types.h>

#include "flotilla/data/distribute.h"
#include "flotilla/train/logs.h"
#include "flotilla/train/losses.h"

namespace flotilla::train::detail {

class TrainStep;

// Evaluation mode for a while, then the mode the module had (a callback may evaluate mid-epoch).
struct EvalMode {
  explicit EvalMode(torch::nn::Module& m) : module(m), was_training(m.is_training()) { m.eval(); }
  ~EvalMode() { module.train(was_training); }
  EvalMode(const EvalMode&) = delete;
  EvalMode& operator=(const EvalMode&) = delete;
  torch::nn::Module& module;
  bool was_training;
};

// Loss and metrics of the model (replica 0, its own forward) over every element, each counted
// once, summed over every worker.
EvalResult evaluate_pass(const TrainStep& step, const data::DistributedDataset& data);
// Every element's outputs, on every worker, in the dataset's order (model.h: Model::predict).
Tensors predict_pass(const TrainStep& step, const data::DistributedDataset& data);

} // namespace flotilla::train::detail
