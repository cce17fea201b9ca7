#include "flotilla/kernels/modules.h"

#include "flotilla/kernels/batch_norm_relu.h"
#include "flotilla/kernels/winograd.h"

namespace flotilla::kernels {
namespace {

torch::nn::Conv2dOptions options_of(const torch::nn::detail::ConvNdOptions<2>& o) {
  return torch::nn::Conv2dOptions(o.in_channels(), o.out_channels(), o.kernel_size())
      .stride(o.stride())
      .padding(o.padding())
      .dilation(o.dilation())
      .groups(o.groups())
      .bias(o.bias())
      .padding_mode(o.padding_mode());
}

} // namespace

Conv2dImpl::Conv2dImpl(const torch::nn::Conv2d& conv)
    : options(options_of(conv->options)), weight(conv->weight), bias(conv->bias), conv_(conv) {
  register_parameter("weight", weight, weight.requires_grad());
  if (bias.defined()) register_parameter("bias", bias, bias.requires_grad());
}

void Conv2dImpl::reset() {
  // A copy (Cloneable::clone) gets a Conv2d of its own, whose parameters clone() then fills.
  conv_ = torch::nn::Conv2d(options);
  weight = register_parameter("weight", conv_->weight);
  bias = conv_->bias;
  if (bias.defined()) register_parameter("bias", bias);
}

torch::Tensor Conv2dImpl::forward(const torch::Tensor& x) {
  return conv2d(*conv_, x);
}

void Conv2dImpl::pretty_print(std::ostream& stream) const {
  stream << "flotilla::kernels::";
  conv_->pretty_print(stream);
}

BatchNormReLUImpl::BatchNormReLUImpl(const torch::nn::BatchNorm2d& bn,
                                     std::optional<double> ceiling)
    : options(bn->options), ceiling(ceiling), bn_(bn) {
  adopt();
}

void BatchNormReLUImpl::adopt() {
  if (bn_->weight.defined()) register_parameter("weight", bn_->weight, bn_->weight.requires_grad());
  if (bn_->bias.defined()) register_parameter("bias", bn_->bias, bn_->bias.requires_grad());
  for (const char* name : {"running_mean", "running_var", "num_batches_tracked"}) {
    const torch::Tensor* buffer = bn_->named_buffers(false).find(name);
    if (buffer != nullptr && buffer->defined()) register_buffer(name, *buffer);
  }
}

void BatchNormReLUImpl::reset() {
  bn_ = torch::nn::BatchNorm2d(options);
  adopt();
}

torch::Tensor BatchNormReLUImpl::forward(const torch::Tensor& x) {
  // The mode is this module's (train() reaches registered modules only).
  if (bn_->is_training() != is_training()) bn_->train(is_training());
  return batch_norm_relu(*bn_, x, {}, ceiling);
}

void BatchNormReLUImpl::pretty_print(std::ostream& stream) const {
  stream << "flotilla::kernels::BatchNormReLU" << (ceiling ? "6" : "") << "("
         << options.num_features() << ", eps=" << options.eps() << ")";
}

} // namespace flotilla::kernels
