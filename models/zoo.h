// The built-in models used by the CLI, the tests and the benchmarks against other stacks.
// Their shapes are fixed: peers (PyTorch DDP, TF MWMS) build the same layers for comparisons.
//   mlp       784-256-256-10, ReLU
//   mlp-wide  784-2048-2048-10, ReLU
//   cnn       conv 1→32 3×3 pad 1, ReLU, maxpool 2; conv 32→64 3×3 pad 1, ReLU, maxpool 2;
//             linear 3136→128, ReLU; linear 128→10
// All take [N, 1, 28, 28] images and return [N, 10] logits.
#pragma once

#include <torch/nn/modules/container/sequential.h>

#include <string>
#include <vector>

namespace flotilla::models {

const std::vector<std::string>& model_names();

// ConfigError for an unknown name, listing the known ones.
torch::nn::Sequential make_model(const std::string& name);

} // namespace flotilla::models
