#include "flotilla/kernels/batch_norm_relu.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <torch/autograd.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "kernels/batch_norm_relu_kernel.h"
#include "kernels/cpu.h"
#include "kernels/measure.h"

namespace flotilla::kernels {
namespace {

namespace kernel = batch_norm_relu_kernels;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

constexpr std::int64_t kLanes = 16; // the channels: a multiple of either kernel's vector
// Rows per kernel call; each block's sums are added in block order, so the result is the same for
// any number of threads.
constexpr std::int64_t kBlockRows = 256;

CpuKernelChoice<kernel::Kernel>& choice() {
  // "avx512" rounds to bfloat16 with AVX512_BF16's instruction where the CPU has it.
  static CpuKernelChoice<kernel::Kernel> choice(
      "FLOTILLA_BATCH_NORM_RELU_KERNEL",
      cpu_runs("avx512bf16") ? kernel::kAvx512Bf16 : kernel::kAvx512, kernel::kAvx2);
  return choice;
}

// Row `row` of a channels-last tensor viewed as [rows][C].
const void* row_of(const torch::Tensor& t, std::int64_t row) {
  return static_cast<const char*>(t.const_data_ptr()) + row * t.size(1) * t.element_size();
}
void* row_of(torch::Tensor& t, std::int64_t row) {
  return static_cast<char*>(t.mutable_data_ptr()) + row * t.size(1) * t.element_size();
}

kernel::Rows rows_of(const torch::Tensor& x, std::int64_t begin, std::int64_t end) {
  return {row_of(x, begin), static_cast<long>(end - begin), static_cast<long>(x.size(1)),
          x.scalar_type() == torch::kBFloat16};
}

// Calls f(block, first row, end row) for every block of kBlockRows rows, blocks split among
// threads.
template <class F> void for_each_block(std::int64_t rows, F&& f) {
  const std::int64_t blocks = (rows + kBlockRows - 1) / kBlockRows;
  at::parallel_for(0, blocks, 4, [&](std::int64_t begin, std::int64_t end) {
    for (std::int64_t b = begin; b < end; ++b) {
      f(b, b * kBlockRows, std::min(rows, (b + 1) * kBlockRows));
    }
  });
}

// Two per-channel sums: f(first row, end row, sum, other sum) adds a block's into the doubles
// given; each block has its own, added in block order (the same result for any thread count).
template <class F>
std::pair<std::vector<double>, std::vector<double>> block_sums(std::int64_t rows, std::int64_t c,
                                                               F&& f) {
  const std::int64_t blocks = (rows + kBlockRows - 1) / kBlockRows;
  std::vector<double> partial(blocks * 2 * c, 0.0);
  for_each_block(rows, [&](std::int64_t b, std::int64_t begin, std::int64_t end) {
    f(begin, end, &partial[b * 2 * c], &partial[b * 2 * c + c]);
  });
  std::vector<double> first(c, 0.0), second(c, 0.0);
  for (std::int64_t b = 0; b < blocks; ++b) {
    for (std::int64_t j = 0; j < c; ++j) {
      first[j] += partial[b * 2 * c + j];
      second[j] += partial[b * 2 * c + c + j];
    }
  }
  return {first, second};
}

std::int64_t rows_in(const torch::Tensor& x) {
  return x.numel() / x.size(1);
}

// A [C] float tensor's values (a copy where it is another type or not contiguous).
std::vector<double> values_of(const torch::Tensor& t) {
  const torch::Tensor f = t.detach().to(torch::kFloat).contiguous();
  return std::vector<double>(f.const_data_ptr<float>(), f.const_data_ptr<float>() + f.numel());
}

// Per-channel values are worked out in loops, not tensor operations: each of those costs
// microseconds, as much as a pass over a small layer's activations.
struct Moments {
  std::vector<double> mean, var; // var biased (divided by the rows)
};

// The batch's. Sums of x minus its first row (shifted data: no cancellation where the mean is
// large against the spread).
Moments batch_moments(const kernel::Kernel& k, const torch::Tensor& x) {
  const std::int64_t c = x.size(1), rows = rows_in(x);
  std::vector<float> origin(c);
  const std::vector<double> first = values_of(x.permute({0, 2, 3, 1}).reshape({rows, c})[0]);
  std::copy(first.begin(), first.end(), origin.begin());
  auto [sum, squares] =
      block_sums(rows, c, [&](std::int64_t begin, std::int64_t end, double* s, double* q) {
        k.statistics(rows_of(x, begin, end), origin.data(), s, q);
      });
  Moments m{std::vector<double>(c), std::vector<double>(c)};
  for (std::int64_t j = 0; j < c; ++j) {
    const double shifted = sum[j] / static_cast<double>(rows);
    m.mean[j] = origin[j] + shifted;
    m.var[j] = std::max(0.0, squares[j] / static_cast<double>(rows) - shifted * shifted);
  }
  return m;
}

// As ATen's batch_norm updates them in training: running = (1 - factor) * running + factor *
// batch, the variance unbiased. Either may be undefined (not tracked).
void update_running_statistics(torch::Tensor running_mean, torch::Tensor running_var,
                               double factor, const Moments& m, std::int64_t rows) {
  torch::NoGradGuard no_grad;
  const double unbiased = static_cast<double>(rows) / static_cast<double>(rows - 1);
  const auto update = [&](torch::Tensor& running, const std::vector<double>& batch, double scale) {
    if (!running.defined()) return;
    if (running.scalar_type() == torch::kFloat && running.is_contiguous()) {
      float* r = running.mutable_data_ptr<float>();
      for (std::size_t j = 0; j < batch.size(); ++j) {
        r[j] = static_cast<float>((1.0 - factor) * r[j] + factor * scale * batch[j]);
      }
    } else {
      const torch::Tensor values = torch::tensor(std::vector<double>(batch));
      running.mul_(1.0 - factor).add_(values.to(running.scalar_type()), factor * scale);
    }
  };
  update(running_mean, m.mean, 1.0);
  update(running_var, m.var, unbiased);
}

// Per channel, as floats: [kMean] and [kInvstd] the step normalizes with, [kScale] and [kShift]
// what it applies (weight * invstd; bias - mean * scale). One [4, C] tensor.
enum { kMean, kInvstd, kScale, kShift };
torch::Tensor per_channel(const torch::Tensor& weight, const torch::Tensor& bias, double eps,
                          const Moments& m) {
  const std::int64_t c = static_cast<std::int64_t>(m.mean.size());
  torch::Tensor t = torch::empty({4, c}, torch::kFloat);
  float* p = t.mutable_data_ptr<float>();
  const std::vector<double> w = values_of(weight), b = values_of(bias);
  for (std::int64_t j = 0; j < c; ++j) {
    const double invstd = 1.0 / std::sqrt(m.var[j] + eps);
    const double scale = w[j] * invstd;
    p[kMean * c + j] = static_cast<float>(m.mean[j]);
    p[kInvstd * c + j] = static_cast<float>(invstd);
    p[kScale * c + j] = static_cast<float>(scale);
    p[kShift * c + j] = static_cast<float>(b[j] - m.mean[j] * scale);
  }
  return t;
}

const float* row(const torch::Tensor& channels, int which) {
  return channels.const_data_ptr<float>() + which * channels.size(1);
}

// ReLU's ceiling: none (infinity), or ReLU6's 6.
float ceiling_of(const std::optional<double>& ceiling) {
  return ceiling ? static_cast<float>(*ceiling) : std::numeric_limits<float>::infinity();
}

// min(relu(x * scale + shift (+ residual, where `add`)), ceiling).
torch::Tensor normalized(const kernel::Kernel& k, const torch::Tensor& x,
                         const torch::Tensor& residual, bool add, const torch::Tensor& channels,
                         float ceiling) {
  torch::Tensor y = torch::empty_like(x); // x's channels-last strides
  for_each_block(rows_in(x), [&](std::int64_t, std::int64_t begin, std::int64_t end) {
    k.normalize(rows_of(x, begin, end), add ? row_of(residual, begin) : nullptr,
                row(channels, kScale), row(channels, kShift), ceiling, row_of(y, begin));
  });
  return y;
}

// x channels-last, float32 or bfloat16; weight and bias [C] float32; `channels` per_channel's,
// which carry no gradient; the residual (as x) or null.
torch::Tensor forward_saving(AutogradContext* ctx, const torch::Tensor& x,
                             const torch::Tensor& weight, const torch::Tensor& channels,
                             const torch::Tensor* residual, double ceiling) {
  const torch::Tensor y = normalized(*choice().kernel(), x, residual ? *residual : x,
                                     residual != nullptr, channels, static_cast<float>(ceiling));
  ctx->save_for_backward({x, y, weight, channels});
  ctx->saved_data["ceiling"] = ceiling;
  return y;
}

// The gradients of x, weight and bias, none for `channels`, and the residual's where
// `residual`.
variable_list backward_of(AutogradContext* ctx, const variable_list& grads, bool residual) {
  const auto saved = ctx->get_saved_variables();
  const torch::Tensor &x = saved[0], &y = saved[1], &weight = saved[2], &channels = saved[3];
  const kernel::Kernel& k = choice().kernel_for_backward();
  const float ceiling = static_cast<float>(ctx->saved_data["ceiling"].toDouble());
  const torch::Tensor gy =
      grads[0].to(x.scalar_type()).contiguous(torch::MemoryFormat::ChannelsLast);
  const std::int64_t c = x.size(1), rows = rows_in(x);
  const float* mean = row(channels, kMean);
  auto [sum_g, sum_gx] =
      block_sums(rows, c, [&](std::int64_t begin, std::int64_t end, double* s, double* q) {
        k.backward_sums(rows_of(x, begin, end), row_of(y, begin), row_of(gy, begin), mean,
                        ceiling, s, q);
      });
  // gx = w * invstd * (g - mean(g) - (x - mean) * invstd^2 * mean(g * (x - mean))):
  // g * scale + (x - mean) * slope + offset. Then the weight's and bias's gradients.
  torch::Tensor factors = torch::empty({3, c}, torch::kFloat);
  torch::Tensor parameter_grads = torch::empty({2, c}, torch::kFloat);
  float* f = factors.mutable_data_ptr<float>();
  float* pg = parameter_grads.mutable_data_ptr<float>();
  const float* invstd = row(channels, kInvstd);
  const float* scale = row(channels, kScale);
  for (std::int64_t j = 0; j < c; ++j) {
    const double is = invstd[j], s = scale[j], n = static_cast<double>(rows);
    f[j] = scale[j];
    f[c + j] = static_cast<float>(-s * is * is * sum_gx[j] / n);
    f[2 * c + j] = static_cast<float>(-s * sum_g[j] / n);
    pg[j] = static_cast<float>(sum_gx[j] * is);
    pg[c + j] = static_cast<float>(sum_g[j]);
  }
  torch::Tensor gx = torch::empty_like(x);
  torch::Tensor g_residual = residual ? torch::empty_like(x) : torch::Tensor();
  for_each_block(rows, [&](std::int64_t, std::int64_t begin, std::int64_t end) {
    k.backward_input(rows_of(x, begin, end), row_of(y, begin), row_of(gy, begin), mean, f, f + c,
                     f + 2 * c, ceiling, row_of(gx, begin),
                     residual ? row_of(g_residual, begin) : nullptr);
  });
  variable_list result = {gx, parameter_grads[0].to(weight.scalar_type()),
                          parameter_grads[1].to(weight.scalar_type()), torch::Tensor()};
  if (residual) result.push_back(g_residual);
  return result;
}

// relu(batch_norm(x)), and relu(batch_norm(x) + residual): two functions, as an undefined
// tensor cannot be an input.
class BatchNormReLUFunction : public torch::autograd::Function<BatchNormReLUFunction> {
 public:
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x,
                               const torch::Tensor& weight, const torch::Tensor& bias,
                               const torch::Tensor& channels, double ceiling) {
    return forward_saving(ctx, x, weight, channels, nullptr, ceiling);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto g = backward_of(ctx, grads, false);
    g.push_back(torch::Tensor()); // the ceiling's
    return g;
  }
};

class BatchNormAddReLUFunction : public torch::autograd::Function<BatchNormAddReLUFunction> {
 public:
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x,
                               const torch::Tensor& weight, const torch::Tensor& bias,
                               const torch::Tensor& channels, const torch::Tensor& residual,
                               double ceiling) {
    return forward_saving(ctx, x, weight, channels, &residual, ceiling);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto g = backward_of(ctx, grads, true);
    g.push_back(torch::Tensor()); // the ceiling's
    return g;
  }
};

torch::Tensor defined_or_empty(const std::optional<torch::Tensor>& t) {
  return t ? *t : torch::Tensor();
}

bool kernel_applies(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias,
                    const torch::Tensor& residual) {
  const auto channels_last = torch::MemoryFormat::ChannelsLast;
  return choice().kernel() != nullptr && x.defined() && x.device().is_cpu() && x.dim() == 4 &&
         (x.scalar_type() == torch::kFloat || x.scalar_type() == torch::kBFloat16) &&
         x.size(1) % kLanes == 0 && rows_in(x) > 1 && x.is_contiguous(channels_last) &&
         weight.defined() && bias.defined() && weight.device().is_cpu() &&
         bias.device().is_cpu() && weight.numel() == x.size(1) && bias.numel() == x.size(1) &&
         weight.scalar_type() == torch::kFloat && bias.scalar_type() == torch::kFloat &&
         (!residual.defined() ||
          (residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type() &&
           residual.device().is_cpu() && residual.is_contiguous(channels_last)));
}

torch::Tensor aten_batch_norm_relu(const torch::Tensor& x, const torch::Tensor& weight,
                                   const torch::Tensor& bias, const torch::Tensor& running_mean,
                                   const torch::Tensor& running_var, bool training,
                                   double momentum, double eps, const torch::Tensor& residual,
                                   const std::optional<double>& ceiling) {
  const torch::Tensor y = at::batch_norm(x, weight, bias, running_mean, running_var, training,
                                         momentum, eps, /*cudnn_enabled=*/true);
  const torch::Tensor sum = residual.defined() ? y + residual : y;
  return ceiling ? torch::hardtanh(sum, 0, *ceiling) : torch::relu(sum);
}

// flotilla's kernels, where kernel_applies and the statistics are the batch's or no gradient is
// wanted.
torch::Tensor kernel_batch_norm_relu(const torch::Tensor& x, const torch::Tensor& weight,
                                     const torch::Tensor& bias, const torch::Tensor& running_mean,
                                     const torch::Tensor& running_var, bool training,
                                     double momentum, double eps, const torch::Tensor& residual,
                                     const std::optional<double>& ceiling, bool needs_grad) {
  RECORD_FUNCTION("flotilla::batch_norm_relu", std::vector<c10::IValue>({x}));
  const kernel::Kernel& k = *choice().kernel();
  Moments moments;
  if (training) {
    moments = batch_moments(k, x);
    update_running_statistics(running_mean, running_var, momentum, moments, rows_in(x));
  } else {
    moments = {values_of(running_mean), values_of(running_var)};
  }
  const torch::Tensor channels = per_channel(weight, bias, eps, moments);
  const float cap = ceiling_of(ceiling);
  if (needs_grad) {
    return residual.defined()
               ? BatchNormAddReLUFunction::apply(x, weight, bias, channels, residual, cap)
               : BatchNormReLUFunction::apply(x, weight, bias, channels, cap);
  }
  return normalized(k, x, residual, residual.defined(), channels, cap);
}

// Both candidates on inputs of x's shape, type and layout, with the site's residual or none.
detail::Candidates candidates(const torch::Tensor& x, bool with_residual, bool training_mode,
                              double eps, const std::optional<double>& ceiling, bool needs_grad) {
  at::Generator generator = at::make_generator<at::CPUGeneratorImpl>(0x5eed);
  const std::int64_t c = x.size(1);
  const auto grad = [&](torch::Tensor t) { return t.requires_grad_(needs_grad); };
  const torch::Tensor xs = grad(torch::randn(x.sizes(), generator, x.options())
                                    .contiguous(torch::MemoryFormat::ChannelsLast));
  const torch::Tensor weight = grad(torch::rand({c}, generator) + 0.5);
  const torch::Tensor bias = grad(torch::randn({c}, generator));
  const torch::Tensor mean = torch::zeros({c}), var = torch::ones({c});
  torch::Tensor residual, gy;
  const auto like_x = [&] {
    return torch::randn(x.sizes(), generator, x.options())
        .contiguous(torch::MemoryFormat::ChannelsLast);
  };
  if (with_residual) residual = grad(like_x());
  if (needs_grad) gy = like_x();
  const auto run = [=](const torch::Tensor& y) {
    if (!needs_grad) return;
    std::vector<torch::Tensor> inputs = {xs, weight, bias};
    if (residual.defined()) inputs.push_back(residual);
    torch::autograd::grad({y}, inputs, {gy});
  };
  return {[=] {
            run(kernel_batch_norm_relu(xs, weight, bias, mean, var, training_mode, 0.1, eps,
                                       residual, ceiling, needs_grad));
          },
          [=] {
            run(aten_batch_norm_relu(xs, weight, bias, mean, var, training_mode, 0.1, eps,
                                     residual, ceiling));
          }};
}

} // namespace

bool batch_norm_relu_applies(const torch::Tensor& x, const torch::Tensor& weight,
                             const torch::Tensor& bias, const torch::Tensor& residual) {
  return kernel_applies(x, weight, bias, residual);
}

torch::Tensor batch_norm_relu(const torch::Tensor& x, const std::optional<torch::Tensor>& weight,
                              const std::optional<torch::Tensor>& bias,
                              const std::optional<torch::Tensor>& running_mean,
                              const std::optional<torch::Tensor>& running_var, bool training,
                              double momentum, double eps,
                              const std::optional<torch::Tensor>& residual_,
                              const std::optional<double>& ceiling) {
  const torch::Tensor w = defined_or_empty(weight), b = defined_or_empty(bias),
                      mean = defined_or_empty(running_mean), var = defined_or_empty(running_var),
                      residual = defined_or_empty(residual_);
  const bool needs_grad = torch::GradMode::is_enabled() &&
                          (x.requires_grad() || (w.defined() && w.requires_grad()) ||
                           (b.defined() && b.requires_grad()) ||
                           (residual.defined() && residual.requires_grad()));
  // Evaluation with gradients (a frozen BatchNorm being trained through) is ATen's, and so is
  // evaluation without running statistics.
  const bool kernel = kernel_applies(x, w, b, residual) && (training || !needs_grad) &&
                      (training || (mean.defined() && var.defined()));
  if (kernel) {
    const std::string key = detail::shape_text(x.sizes().vec()) +
                            (x.scalar_type() == torch::kBFloat16 ? " bf16" : " f32") +
                            (residual.defined() ? " +residual" : "") +
                            (ceiling ? " ceiling " + c10::str(*ceiling) : "") +
                            (training ? "" : " running-statistics");
    if (detail::use_flotilla(residual.defined() ? "batch_norm_add_relu" : "batch_norm_relu", key,
                             needs_grad, [&] {
                               return candidates(x, residual.defined(), training, eps, ceiling,
                                                 needs_grad);
                             })) {
      return kernel_batch_norm_relu(x, w, b, mean, var, training, momentum, eps, residual,
                                    ceiling, needs_grad);
    }
  }
  return aten_batch_norm_relu(x, w, b, mean, var, training, momentum, eps, residual, ceiling);
}

torch::Tensor batch_norm_relu(torch::nn::BatchNorm2dImpl& bn, const torch::Tensor& x,
                              const torch::Tensor& residual,
                              const std::optional<double>& ceiling) {
  // BatchNormImplBase::forward's bookkeeping: the batches counted, and momentum's factor (a
  // cumulative average where momentum is unset).
  double factor = bn.options.momentum().value_or(0.0);
  const bool track = bn.options.track_running_stats();
  if (bn.is_training() && track && bn.num_batches_tracked.defined()) {
    torch::NoGradGuard no_grad;
    bn.num_batches_tracked += 1;
    if (!bn.options.momentum()) factor = 1.0 / bn.num_batches_tracked.item<double>();
  }
  return batch_norm_relu(x, bn.weight, bn.bias, track ? bn.running_mean : torch::Tensor(),
                         track ? bn.running_var : torch::Tensor(), bn.is_training() || !track,
                         factor, bn.options.eps(),
                         residual.defined() ? std::optional<torch::Tensor>(residual) : std::nullopt,
                         ceiling);
}

const char* batch_norm_relu_kernel() {
  return choice().name();
}

bool use_batch_norm_relu_kernel(const std::string& name) {
  return choice().use(name);
}

} // namespace flotilla::kernels
