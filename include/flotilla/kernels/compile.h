// The compile step on the CPU (what Keras's jit_compile means there; train::CompileOptions
// runs it): a model rewritten so that flotilla's kernels can run its layers, each then chosen
// against ATen's by measurement (choice.h). What it rewrites keeps the model's parameters — the
// same tensors, under the same names — so the optimizer's state, checkpoints, safetensors names
// and state_dict are those of the model as written.
//
// A torch::nn tree: the layers of every Sequential, at any depth, where they form one of these
// (a module's own forward calls its members directly, so only a Sequential's layers can be
// swapped; what was left and why is in the report):
//   Conv2d 3x3, stride 1, padding 1, no bias            -> Conv2d by conv2d(): Winograd's F(4x4, 3x3)
//   any other Conv2d of zero padding, under bfloat16     -> Conv2d by conv2d(): float32 arithmetic
//                                                           on bfloat16 activations
//   BatchNorm2d, ReLU (or ReLU6)                          -> BatchNormReLU (one pass less each way)
//   Conv2d 1->C 3x3 padding 1, ReLU, MaxPool2d(2)         -> ConvMaxPool2ReLU (the first layer of a
//                                                            grayscale CNN in one kernel)
//   ReLU, MaxPool2d(2)                                    -> MaxPool2ReLU
//   GELU, Dropout                                         -> GeluDropout
//   Dropout                                               -> Dropout (hashed masks)
// A swapped layer takes the first layer's name; the others become Identity under their names.
//
// A TorchScript module (torch.jit.script or torch.jit.trace in Python): its forward, with every
// method and function it calls inlined, where
//   aten::conv2d (or a trace's aten::_convolution) of stride 1, padding 1, dilation 1, one group
//     and no bias; under bfloat16 any 2-D one with padding
//     given as numbers                                      -> flotilla::conv2d
//   aten::batch_norm then relu (or relu_, or ReLU6's
//     hardtanh(0, 6))                                      -> flotilla::batch_norm_relu
//   aten::batch_norm then add (or add_) then relu          -> flotilla::batch_norm_relu with the
//                                                             added tensor as its residual
// The operations are registered with TORCH_LIBRARY (schemas like aten's) and compute their own
// gradients; each checks at run time what it can see only then (the weight's size, the type and
// layout) and runs ATen's operation where flotilla's kernel does not apply or lost.
#pragma once

#include <torch/csrc/jit/api/module.h>
#include <torch/nn/module.h>

#include <map>
#include <string>
#include <vector>

namespace flotilla::kernels {

struct CompileReport {
  // Layers rewritten, by what they became ("Conv2d (Winograd)": 16, ...).
  std::map<std::string, int> rewritten;
  // Layers left to ATen, by why ("Conv2d: stride 2": 3, ...).
  std::map<std::string, int> left;
  // One line: what was rewritten and what was left, with the reasons.
  std::string summary() const;
};

// Rewrites `module`'s Sequentials in place (see above). Nothing happens under Mode::kNone.
// `bfloat16`: the model will train under CPU autocast to bfloat16, where every other 2-D
// convolution (1x1, strided, grouped, any channels: not Winograd's) becomes one that computes in
// float32 on the bfloat16 activations where that measured faster (convolution.h); in float32
// they are left to ATen.
CompileReport compile(torch::nn::Module& module, bool bfloat16 = false);

// A copy of `module` whose forward is rewritten (its parameters and buffers are the same tensors:
// the copy trains the original's). `module` itself is unchanged; a forward it already ran does
// not matter. `bfloat16` as above.
torch::jit::Module compile(const torch::jit::Module& module, CompileReport& report,
                           bool bfloat16 = false);

} // namespace flotilla::kernels
