// Private: SyncBatchNorm's training computation, shared by SyncBatchNormImpl and the
// flotilla::sync_batch_norm operator that TorchScript modules call (torchscript.cpp).
#pragma once

#include <torch/types.h>

#include <functional>

#include "flotilla/strategy/replica_context.h"

namespace flotilla::train::detail {

// Batch norm of `input` [N, C, ...] with the mean and variance of every replica's batch (one
// all-reduce through `context`; a replica alone: its own), and a backward that sums its
// statistics the same way. `running_mean` and `running_var`, where defined, move towards the
// global statistics by momentum(), called once, after the statistics are known. ConfigError when
// the global batch has at most one value per channel.
torch::Tensor global_batch_norm(const torch::Tensor& input, const torch::Tensor& weight,
                                const torch::Tensor& bias, const torch::Tensor& running_mean,
                                const torch::Tensor& running_var,
                                const std::function<double()>& momentum, double eps,
                                const strategy::ReplicaContext& context);

} // namespace flotilla::train::detail
