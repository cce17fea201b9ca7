// The built-in models used by the CLI, the tests and the benchmarks against other stacks.
// Their shapes are fixed: peers (PyTorch DDP, TF MWMS; bench/peers) build the same layers.
//   mlp       784-256-256-10, ReLU
//   mlp-wide  784-2048-2048-10, ReLU
//   cnn       conv 1→32 3×3 pad 1, ReLU, maxpool 2; conv 32→64 3×3 pad 1, ReLU, maxpool 2;
//             linear 3136→128, ReLU; linear 128→10
//   resnet20  He et al.'s CIFAR ResNet-20: conv 3×3 1→16, BatchNorm, ReLU; three stages of three
//             basic blocks (16, 32, 64 channels; the 2nd and 3rd stages start with stride 2;
//             a 1×1 conv + BatchNorm shortcut where the shape changes); global average pool;
//             linear 64→10. 272,186 parameters.
//   resnet18  the ImageNet ResNet-18 for small images: conv 3×3 1→64 stride 1, no max-pool;
//             stages of two basic blocks, 64/128/256/512 channels; average pool; linear 512→10.
//             11,172,810 parameters (45 MB of float32 gradients: several buckets).
//   vit-tiny  ViT, patch 4 (49 patches of 28×28) to width 192, a class token, learned position
//             embeddings; depth 6 of pre-norm blocks (3 heads, MLP 768, GELU), LayerNorm eps 1e-6,
//             dropout 0.1; LayerNorm and linear 192→10 on the class token.
// All take [N, 1, 28, 28] images and return [N, 10] logits. They are plain torch::nn, as a
// user's model is: flotilla's kernels reach them through the compile step
// (flotilla/kernels/compile.h), which swaps their Sequentials' layers; ViT's attention calls
// kernels::attention as a user's module would. The residual blocks are ReplaceableChildren, so
// train::convert_sync_batchnorm converts the ResNets.
#pragma once

#include <torch/nn/modules/container/sequential.h>

#include <string>
#include <vector>

namespace flotilla::models {

const std::vector<std::string>& model_names();

// ConfigError for an unknown name, listing the known ones.
torch::nn::Sequential make_model(const std::string& name);

} // namespace flotilla::models
