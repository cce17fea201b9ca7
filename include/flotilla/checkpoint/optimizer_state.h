// An optimizer's state as named tensors and back: what a checkpoint's optimizer file holds, and
// what the elastic state transfer sends.
#pragma once

#include <torch/optim/optimizer.h>

#include "flotilla/checkpoint/model_checkpoint.h"

namespace flotilla::checkpoint {

// Optimizer state as named tensors, for torch::optim::SGD (momentum_buffer), Adam and AdamW
// (step, exp_avg, exp_avg_sq, and max_exp_avg_sq with amsgrad):
//   "state.<i>.<field>"     parameter i, counted across the parameter groups in order (the
//                           numbering of PyTorch's optimizer.state_dict()); a parameter that
//                           has no state yet (no update taken) has no names at all
//   "param_groups.<g>.lr"   group g's current learning rate (0-dim float64)
// "step" is a 0-dim int64. Tensors are detached views of the optimizer's own (no copy).
// Any other optimizer (LibTorch's RMSprop or Adagrad, one of your own) is kept whole in
// LibTorch's archive of it (Optimizer::save), as one uint8 tensor "torch_archive" (torch.jit.load
// reads it in Python); CheckpointError when its save() writes nothing.
NamedTensors optimizer_state(const torch::optim::Optimizer& optimizer);

// Restores optimizer_state() into an optimizer of the same type over the same parameters,
// creating state objects for parameters that have none yet and dropping state for those that
// had none when saved. Every name and shape is checked before anything changes: an unexpected
// or missing name, a parameter index or group beyond the optimizer's, or a shape that differs
// from the parameter's is a CheckpointError naming it. An archived optimizer is loaded by its own
// load(), then every state tensor's shape is checked; on failure its previous state is put back.
void load_optimizer_state(torch::optim::Optimizer& optimizer, const NamedTensors& state);

} // namespace flotilla::checkpoint
