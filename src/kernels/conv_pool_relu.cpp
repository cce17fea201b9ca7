#include "flotilla/kernels/conv_pool_relu.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <ATen/autocast_mode.h>
#include <ATen/record_function.h>
#include <torch/autograd.h>
#include <torch/nn/modules/conv.h>
#include <torch/torch.h>

#include <string>
#include <vector>

#include "flotilla/kernels/max_pool_relu.h"
#include "kernels/conv_pool_relu_kernel.h"
#include "kernels/cpu.h"
#include "kernels/measure.h"

namespace flotilla::kernels {
namespace {

namespace kernel = conv_pool_relu;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

constexpr std::int64_t kLanes = 16;

CpuKernelChoice<kernel::Kernel>& choice() {
  static CpuKernelChoice<kernel::Kernel> choice("FLOTILLA_CONV_POOL_KERNEL", kernel::kAvx512, kernel::kAvx2);
  return choice;
}

// The images as floats with a zero border of one pixel: [N, H+2, W+2].
torch::Tensor padded_images(const torch::Tensor& x) {
  return torch::constant_pad_nd(x.reshape({x.size(0), x.size(2), x.size(3)}).to(torch::kFloat),
                                {1, 1, 1, 1})
      .contiguous();
}

kernel::Image image_of(const torch::Tensor& padded, std::int64_t n, std::int64_t channels) {
  const std::int64_t h = padded.size(1) - 2, w = padded.size(2) - 2;
  return {padded.const_data_ptr<float>() + n * (h + 2) * (w + 2), h, w, channels};
}

// NHWC strides for the pooled output's NCHW shape.
torch::Tensor empty_channels_last(std::int64_t n, std::int64_t c, std::int64_t h, std::int64_t w,
                                  const torch::TensorOptions& options) {
  return torch::empty_strided({n, c, h, w}, {h * w * c, 1, w * c, c}, options);
}

class ConvMaxPool2ReLUFunction : public torch::autograd::Function<ConvMaxPool2ReLUFunction> {
 public:
  // x [N, 1, H, W] (no gradient), weight [C, 1, 3, 3], bias [C], all of one type (float32 or
  // bfloat16, the output's).
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x,
                               const torch::Tensor& weight, const torch::Tensor& bias) {
    const std::int64_t n = x.size(0), c = weight.size(0), oh = x.size(2) / 2, ow = x.size(3) / 2;
    const bool bf16 = weight.scalar_type() == torch::kBFloat16;
    const torch::Tensor padded = padded_images(x);
    // [9][C]: the taps of each output channel side by side.
    const torch::Tensor taps = weight.to(torch::kFloat).reshape({c, 9}).t().contiguous();
    const torch::Tensor b = bias.to(torch::kFloat).contiguous();
    torch::Tensor y = empty_channels_last(n, c, oh, ow, weight.options());
    torch::Tensor code = torch::empty({n, oh, ow, c}, x.options().dtype(torch::kUInt8));
    const auto forward = choice().kernel()->forward;
    const std::int64_t per_image = oh * ow * c;
    auto* out = static_cast<char*>(y.data_ptr());
    const std::int64_t element = y.element_size();
    std::uint8_t* codes = code.mutable_data_ptr<std::uint8_t>();
    at::parallel_for(0, n, 1, [&](std::int64_t begin, std::int64_t end) {
      for (std::int64_t i = begin; i < end; ++i) {
        forward(image_of(padded, i, c), taps.const_data_ptr<float>(), b.const_data_ptr<float>(),
                out + i * per_image * element, codes + i * per_image, bf16);
      }
    });
    ctx->save_for_backward({padded, code});
    ctx->saved_data["bf16"] = bf16;
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const torch::Tensor& padded = saved[0];
    const torch::Tensor& code = saved[1];
    const std::int64_t n = code.size(0), c = code.size(3), per_image = code.numel() / n;
    // The pooled gradient in the output's channels-last order (a view where it is already).
    const bool bf16 = ctx->saved_data["bf16"].toBool();
    const torch::Tensor gy =
        grads[0].to(bf16 ? torch::kBFloat16 : torch::kFloat).permute({0, 2, 3, 1}).contiguous();
    // One sum per thread, added in thread order.
    const int threads = at::get_num_threads();
    torch::Tensor sums = torch::zeros({threads, 10, c}, gy.options().dtype(torch::kFloat));
    const auto backward = choice().kernel_for_backward().backward;
    at::parallel_for(0, n, 1, [&](std::int64_t begin, std::int64_t end) {
      float* mine = sums.mutable_data_ptr<float>() + at::get_thread_num() * 10 * c;
      for (std::int64_t i = begin; i < end; ++i) {
        backward(image_of(padded, i, c),
                 static_cast<const char*>(gy.const_data_ptr()) + i * per_image * gy.element_size(),
                 bf16, code.const_data_ptr<std::uint8_t>() + i * per_image, mine, mine + 9 * c);
      }
    });
    const torch::Tensor total = sums.sum(0);
    const auto type = bf16 ? torch::kBFloat16 : torch::kFloat;
    torch::Tensor grad_weight = total.slice(0, 0, 9).t().reshape({c, 1, 3, 3}).to(type);
    torch::Tensor grad_bias = total[9].to(type);
    return {torch::Tensor(), grad_weight, grad_bias};
  }
};

bool runs_kernel(const torch::Tensor& x, const torch::Tensor& weight) {
  return choice().kernel() != nullptr && x.device().is_cpu() && weight.device().is_cpu() &&
         x.dim() == 4 && x.size(1) == 1 && x.size(2) >= 2 && x.size(3) >= 2 && !x.requires_grad() &&
         weight.dim() == 4 && weight.size(1) == 1 && weight.size(2) == 3 && weight.size(3) == 3 &&
         weight.size(0) % kLanes == 0 &&
         (weight.scalar_type() == torch::kFloat || weight.scalar_type() == torch::kBFloat16);
}

torch::Tensor run_kernel(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b) {
  // The FLOP counter (profile::counted_flops) counts it as the convolution it contains.
  RECORD_FUNCTION(
      "flotilla::convolution",
      std::vector<c10::IValue>({x, w, b, std::vector<std::int64_t>{1, 1},
                                std::vector<std::int64_t>{1, 1}, std::vector<std::int64_t>{1, 1},
                                false, std::vector<std::int64_t>{0, 0}, 1}));
  return ConvMaxPool2ReLUFunction::apply(x, w, b);
}

// The kernel's and ATen's (conv2d, relu, max_pool2d) runs on inputs of the site's shapes and
// type (already autocast's).
detail::Candidates candidates(const torch::Tensor& x, const torch::Tensor& w, bool training) {
  at::Generator generator = at::make_generator<at::CPUGeneratorImpl>(0x5eed);
  const torch::Tensor xs = torch::randn(x.sizes(), generator, x.options());
  const torch::Tensor ws = torch::randn(w.sizes(), generator, w.options()).requires_grad_(training);
  const torch::Tensor bs = torch::randn({w.size(0)}, generator, w.options()).requires_grad_(training);
  const std::int64_t oh = x.size(2) / 2, ow = x.size(3) / 2;
  const torch::Tensor gy =
      torch::randn({x.size(0), w.size(0), oh, ow}, generator, w.options());
  const auto run = [=](const torch::Tensor& y) {
    if (training) torch::autograd::grad({y}, {ws, bs}, {gy});
  };
  return {[=] { run(run_kernel(xs, ws, bs)); },
          [=] { run(torch::max_pool2d(torch::relu(torch::conv2d(xs, ws, bs, 1, 1)), 2)); }};
}

} // namespace

torch::Tensor conv_max_pool2_relu(const torch::Tensor& x, const torch::Tensor& weight,
                                  const torch::Tensor& bias) {
  torch::Tensor input = x, w = weight, b = bias;
  if (x.device().is_cpu() && at::autocast::is_autocast_enabled(at::kCPU)) {
    // As autocast runs conv2d: input, weight and bias in its lower precision.
    const auto type = at::autocast::get_autocast_dtype(at::kCPU);
    input = at::autocast::cached_cast(type, x, at::kCPU);
    w = at::autocast::cached_cast(type, weight, at::kCPU);
    b = at::autocast::cached_cast(type, bias, at::kCPU);
  }
  if (runs_kernel(input, w) && input.scalar_type() == w.scalar_type() && b.defined() &&
      b.scalar_type() == w.scalar_type()) {
    const bool training =
        torch::GradMode::is_enabled() && (weight.requires_grad() || bias.requires_grad());
    const std::string key = detail::shape_text(input.sizes().vec()) + ">" +
                            std::to_string(w.size(0)) +
                            (w.scalar_type() == torch::kBFloat16 ? " bf16" : " f32");
    if (detail::use_flotilla("conv_max_pool2_relu", key, training,
                             [&] { return candidates(input, w, training); })) {
      return run_kernel(input, w, b);
    }
  }
  return max_pool2_relu(torch::conv2d(x, weight, bias, 1, 1));
}

ConvMaxPool2ReLUImpl::ConvMaxPool2ReLUImpl(std::int64_t out_channels)
    : out_channels_(out_channels) {
  reset();
}

ConvMaxPool2ReLUImpl::ConvMaxPool2ReLUImpl(const torch::nn::Conv2dImpl& conv)
    : out_channels_(conv.options.out_channels()) {
  weight = register_parameter("weight", conv.weight, conv.weight.requires_grad());
  bias = register_parameter("bias", conv.bias, conv.bias.requires_grad());
}

void ConvMaxPool2ReLUImpl::reset() {
  // torch::nn::Conv2d's initialisation, so the same draws give the same weights.
  torch::nn::Conv2d conv(torch::nn::Conv2dOptions(1, out_channels_, 3).padding(1));
  weight = register_parameter("weight", conv->weight.detach().clone());
  bias = register_parameter("bias", conv->bias.detach().clone());
}

torch::Tensor ConvMaxPool2ReLUImpl::forward(const torch::Tensor& x) {
  return conv_max_pool2_relu(x, weight, bias);
}

void ConvMaxPool2ReLUImpl::pretty_print(std::ostream& stream) const {
  stream << "flotilla::kernels::ConvMaxPool2ReLU(1, " << out_channels_
         << ", kernel_size=[3, 3], padding=[1, 1])";
}

const char* conv_max_pool2_relu_kernel() {
  return choice().name();
}

bool use_conv_max_pool2_relu_kernel(const std::string& name) {
  return choice().use(name);
}

} // namespace flotilla::kernels
