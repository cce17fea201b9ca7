// `build/bench_batch_norm_relu [REPEATS=15] [IMAGES=64] | bench/machine.sh --tag`: a ResNet's
// "BatchNorm, ReLU" and its block's "BatchNorm, add the shortcut, ReLU", training, forward and
// backward, one thread, channels-last: flotilla's batch_norm_relu (flotilla/kernels/batch_norm_relu.h)
// with its kernel, against the module's forward, the add and torch::relu (what it runs with
// FLOTILLA_BATCH_NORM_RELU_KERNEL=none, and what PyTorch's twin runs). Shapes: ResNet-20's three
// stages at IMAGES images (64: a worker's share of a global batch of 128). Prints one JSON line
// per dtype, shape and form: the median milliseconds of each over REPEATS runs (after 3
// untimed), and the ratio. Freed memory is kept, as `flotilla train` keeps it.
#include <torch/torch.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "timing.h"
#include "flotilla/kernels/choice.h"
#include "flotilla/kernels/batch_norm_relu.h"

using flotilla::bench::median_ms;

int main(int argc, char** argv) {
  namespace kernels = flotilla::kernels;
  flotilla::kernels::set_mode(flotilla::kernels::Mode::kFixed); // each kernel, not a measured choice
  const auto [repeats, images] = flotilla::bench::layer_bench(argc, argv, 64, true);
  const std::string best = kernels::batch_norm_relu_kernel();
  const auto cl = torch::MemoryFormat::ChannelsLast;
  for (const auto dtype : {torch::kFloat32, torch::kBFloat16}) {
    for (const auto& [channels, size] :
         {std::pair<std::int64_t, std::int64_t>{16, 28}, {32, 14}, {64, 7}}) {
      for (const bool residual : {false, true}) {
        const std::vector<std::int64_t> shape = {images, channels, size, size};
        torch::nn::BatchNorm2d bn(channels);
        const torch::Tensor x = torch::randn(shape).to(dtype).contiguous(cl).requires_grad_();
        const torch::Tensor r = torch::randn(shape).to(dtype).contiguous(cl).requires_grad_();
        const torch::Tensor grad = torch::randn(shape).to(dtype).contiguous(cl);
        // Gradients returned, not accumulated into .grad (an add per step on either side).
        auto step = [&] {
          const torch::Tensor y = kernels::batch_norm_relu(*bn, x, residual ? r : torch::Tensor());
          std::vector<torch::Tensor> inputs = {x, bn->weight, bn->bias};
          if (residual) inputs.push_back(r);
          torch::autograd::grad({y}, inputs, {grad});
        };
        kernels::use_batch_norm_relu_kernel(best);
        const double fused = median_ms(repeats, step);
        kernels::use_batch_norm_relu_kernel("none");
        const double aten = median_ms(repeats, step);
        kernels::use_batch_norm_relu_kernel(best);
        std::printf(
            "{\"bench\":\"batch_norm_relu\",\"dtype\":\"%s\",\"shape\":[%lld,%lld,%lld,%lld],"
            "\"form\":\"%s\",\"memory_format\":\"channels_last\",\"threads\":1,\"repeats\":%d,"
            "\"metric\":\"forward_backward_ms\",\"kernel\":\"%s\",\"fused\":%.3f,"
            "\"batch_norm_then_relu\":%.3f,\"ratio\":%.3f}\n",
            dtype == torch::kFloat32 ? "float32" : "bfloat16", static_cast<long long>(images),
            static_cast<long long>(channels), static_cast<long long>(size),
            static_cast<long long>(size),
            residual ? "relu(batch_norm(x) + residual)" : "relu(batch_norm(x))", repeats,
            best.c_str(), fused, aten, aten / fused);
      }
    }
  }
  return 0;
}
