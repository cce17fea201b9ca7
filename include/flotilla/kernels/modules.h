// The layers the compile step (compile.h) swaps into a torch::nn tree, each holding the very
// parameters and buffers of the layers it replaces under the same names, so a state_dict,
// checkpoint or optimizer sees the model as written. (The fused layers of one kernel each are in
// conv_pool_relu.h, max_pool_relu.h and dropout.h.)
#pragma once

#include <torch/nn/cloneable.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/pimpl.h>

#include <optional>
#include <ostream>

namespace flotilla::kernels {

// A torch::nn::Conv2d run by conv2d() (winograd.h): Winograd's where it applies and measured
// faster, the Conv2d's own forward elsewhere. Parameters "weight" (and "bias" where the Conv2d
// has one).
class Conv2dImpl : public torch::nn::Cloneable<Conv2dImpl> {
 public:
  // `conv`'s own parameters (the same tensors).
  explicit Conv2dImpl(const torch::nn::Conv2d& conv);
  void reset() override;
  torch::Tensor forward(const torch::Tensor& x);
  void pretty_print(std::ostream& stream) const override;

  torch::nn::Conv2dOptions options;
  torch::Tensor weight, bias;

 private:
  torch::nn::Conv2d conv_; // not registered: its parameters are this module's
};
TORCH_MODULE(Conv2d);

// A torch::nn::BatchNorm2d followed by ReLU (or ReLU6: `ceiling` 6), as batch_norm_relu().
// Parameters "weight" and "bias", buffers "running_mean", "running_var" and
// "num_batches_tracked", as BatchNorm2d's.
class BatchNormReLUImpl : public torch::nn::Cloneable<BatchNormReLUImpl> {
 public:
  // `bn`'s own parameters and buffers (the same tensors).
  explicit BatchNormReLUImpl(const torch::nn::BatchNorm2d& bn,
                             std::optional<double> ceiling = std::nullopt);
  void reset() override;
  torch::Tensor forward(const torch::Tensor& x);
  void pretty_print(std::ostream& stream) const override;

  torch::nn::BatchNormOptions options;
  std::optional<double> ceiling;

 private:
  void adopt(); // registers bn_'s tensors as this module's
  torch::nn::BatchNorm2d bn_; // not registered: its tensors are this module's
};
TORCH_MODULE(BatchNormReLU);

} // namespace flotilla::kernels
