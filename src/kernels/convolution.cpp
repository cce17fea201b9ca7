#include "flotilla/kernels/convolution.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/autocast_mode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/autograd.h>
#include <torch/torch.h>

#include <string>
#include <vector>

#include "flotilla/error.h"
#include "kernels/measure.h"

namespace flotilla::kernels {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// x (bfloat16) by w (float32) in float32, the output rounded to bfloat16; backward likewise.
// Saves the bfloat16 input, not its float32 widening: half the memory a step keeps.
class Float32ConvFunction : public torch::autograd::Function<Float32ConvFunction> {
 public:
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, const torch::Tensor& w,
                               const std::optional<torch::Tensor>& bias,
                               std::vector<std::int64_t> stride, std::vector<std::int64_t> padding,
                               std::vector<std::int64_t> dilation, std::int64_t groups) {
    ctx->save_for_backward({x, w});
    ctx->saved_data["stride"] = stride;
    ctx->saved_data["padding"] = padding;
    ctx->saved_data["dilation"] = dilation;
    ctx->saved_data["groups"] = groups;
    ctx->saved_data["bias"] = bias.has_value();
    // Autocast would cast the float32 operands back to bfloat16.
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::DispatchKey::AutocastCPU);
    return at::convolution(x.to(torch::kFloat), w, bias, stride, padding, dilation, false, {0, 0},
                           groups)
        .to(torch::kBFloat16);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const torch::Tensor &x = saved[0], &w = saved[1];
    const bool bias = ctx->saved_data["bias"].toBool();
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::DispatchKey::AutocastCPU);
    const torch::Tensor gy = grads[0].to(torch::kFloat).contiguous(x.suggest_memory_format());
    const std::vector<std::int64_t> bias_sizes{w.size(0)};
    auto [gx, gw, gb] = at::convolution_backward(
        gy, x.to(torch::kFloat), w,
        bias ? std::optional<at::IntArrayRef>(bias_sizes) : std::nullopt,
        ctx->saved_data["stride"].toIntVector(), ctx->saved_data["padding"].toIntVector(),
        ctx->saved_data["dilation"].toIntVector(), false, {0, 0}, ctx->saved_data["groups"].toInt(),
        {ctx->needs_input_grad(0), ctx->needs_input_grad(1), bias && ctx->needs_input_grad(2)});
    return {gx.defined() ? gx.to(torch::kBFloat16) : gx, gw, gb, {}, {}, {}, {}};
  }
};

torch::Tensor run(const torch::Tensor& x, const torch::Tensor& w,
                  const std::optional<torch::Tensor>& bias, at::IntArrayRef stride,
                  at::IntArrayRef padding, at::IntArrayRef dilation, std::int64_t groups) {
  // x as autocast casts a convolution's input (a float32 input to bfloat16).
  const torch::Tensor input = x.scalar_type() == torch::kBFloat16
                                  ? x
                                  : at::autocast::cached_cast(torch::kBFloat16, x, at::kCPU);
  const std::optional<torch::Tensor> b =
      bias && bias->defined() ? bias : std::optional<torch::Tensor>();
  return Float32ConvFunction::apply(input, w, b, stride.vec(), padding.vec(), dilation.vec(),
                                    groups);
}

// This path's and oneDNN's runs on inputs of x's, w's and bias's shapes, types and layouts.
detail::Candidates candidates(const torch::Tensor& x, const torch::Tensor& w,
                              const std::optional<torch::Tensor>& bias, at::IntArrayRef stride,
                              at::IntArrayRef padding, at::IntArrayRef dilation,
                              std::int64_t groups, bool training) {
  at::Generator generator = at::make_generator<at::CPUGeneratorImpl>(0x5eed);
  const auto random = [&](const torch::Tensor& like) {
    return torch::randn(like.sizes(), generator, like.options())
        .contiguous(like.suggest_memory_format())
        .requires_grad_(like.requires_grad() && training);
  };
  const torch::Tensor xs = random(x), ws = random(w);
  const std::optional<torch::Tensor> bs =
      bias && bias->defined() ? std::optional<torch::Tensor>(random(*bias)) : std::nullopt;
  const std::vector<std::int64_t> s = stride.vec(), p = padding.vec(), d = dilation.vec();
  const auto backward = [=](const torch::Tensor& y) {
    if (!training) return;
    std::vector<torch::Tensor> inputs;
    for (const auto& t : {xs, ws}) {
      if (t.requires_grad()) inputs.push_back(t);
    }
    if (bs && bs->requires_grad()) inputs.push_back(*bs);
    if (!inputs.empty()) torch::autograd::grad({y}, inputs, {torch::ones_like(y)});
  };
  return {[=] { backward(run(xs, ws, bs, s, p, d, groups)); },
          [=] { backward(at::conv2d(xs, ws, bs, s, p, d, groups)); }};
}

} // namespace

bool float32_conv2d_applies(const torch::Tensor& x, const torch::Tensor& weight,
                            const std::optional<torch::Tensor>& bias, at::IntArrayRef stride,
                            at::IntArrayRef padding, at::IntArrayRef dilation,
                            std::int64_t groups) {
  if (!at::autocast::is_autocast_enabled(at::kCPU) ||
      at::autocast::get_autocast_dtype(at::kCPU) != torch::kBFloat16 || !x.defined() ||
      !weight.defined()) {
    return false;
  }
  const bool floating = x.scalar_type() == torch::kFloat || x.scalar_type() == torch::kBFloat16;
  const bool bias_ok = !bias || !bias->defined() ||
                       (bias->scalar_type() == torch::kFloat && bias->device().is_cpu());
  return floating && bias_ok && x.device().is_cpu() && weight.device().is_cpu() &&
         weight.scalar_type() == torch::kFloat && x.dim() == 4 && weight.dim() == 4 &&
         groups >= 1 && x.size(1) == weight.size(1) * groups && stride.size() == 2 &&
         padding.size() == 2 && dilation.size() == 2 && x.numel() > 0;
}

torch::Tensor float32_conv2d(const torch::Tensor& x, const torch::Tensor& weight,
                             const std::optional<torch::Tensor>& bias, at::IntArrayRef stride,
                             at::IntArrayRef padding, at::IntArrayRef dilation,
                             std::int64_t groups) {
  if (!float32_conv2d_applies(x, weight, bias, stride, padding, dilation, groups)) {
    throw ConfigError("float32_conv2d: input " + c10::str(x.sizes()) + " " +
                      c10::toString(x.scalar_type()) + " and weight " + c10::str(weight.sizes()) +
                      " " + c10::toString(weight.scalar_type()) +
                      " are not a 2-D convolution on the CPU under bfloat16 autocast with float32 "
                      "weights (see float32_conv2d_applies)");
  }
  return run(x, weight, bias, stride, padding, dilation, groups);
}

namespace detail {

torch::Tensor other_conv2d(const torch::Tensor& x, const torch::Tensor& weight,
                           const std::optional<torch::Tensor>& bias, at::IntArrayRef stride,
                           at::IntArrayRef padding, at::IntArrayRef dilation, std::int64_t groups) {
  if (!float32_conv2d_applies(x, weight, bias, stride, padding, dilation, groups)) {
    return at::conv2d(x, weight, bias, stride, padding, dilation, groups);
  }
  const bool training =
      torch::GradMode::is_enabled() &&
      (x.requires_grad() || weight.requires_grad() || (bias && bias->requires_grad()));
  const auto list = [](at::IntArrayRef v) {
    return std::to_string(v[0]) + "," + std::to_string(v[1]);
  };
  const bool channels_last = x.is_contiguous(torch::MemoryFormat::ChannelsLast);
  const std::string key = shape_text(x.sizes().vec()) + (channels_last ? " nhwc" : " nchw") + " w" +
                          shape_text(weight.sizes().vec()) + " s" + list(stride) + " p" +
                          list(padding) + " d" + list(dilation) + " g" + std::to_string(groups) +
                          (bias && bias->defined() ? " bias" : "") +
                          (x.scalar_type() == torch::kFloat ? " from f32" : "");
  if (!use_flotilla("conv_float32", key, training, [&] {
        return candidates(x, weight, bias, stride, padding, dilation, groups, training);
      })) {
    return at::conv2d(x, weight, bias, stride, padding, dilation, groups);
  }
  return run(x, weight, bias, stride, padding, dilation, groups);
}

} // namespace detail
} // namespace flotilla::kernels
