// `build/bench_max_pool_relu [REPEATS=15] [IMAGES=256] | bench/machine.sh --tag`: one "ReLU,
// max-pool 2" of a CNN, forward and backward, one thread, channels-last: flotilla's MaxPool2ReLU
// (models/ max_pool_relu.h) against the same values from ATen's kernels in PyTorch's usual order
// (ReLU, then max-pool: what the twins of bench/peers run by default) and pooled first (max-pool,
// then ReLU: what pytorch-ddp-best runs). Shapes: the zoo CNN's two pooling layers at IMAGES images
// (a worker's share of a global batch of 512). Prints one JSON line per dtype and shape: the median
// milliseconds of each over REPEATS runs (after 3 untimed), and the ratios.
// Then the CNN's first layer (3x3 convolution of one-channel images, ReLU, max-pool 2): flotilla's
// ConvMaxPool2ReLU (flotilla/kernels/conv_pool_relu.h) with its kernel, against ATen's conv2d then
// MaxPool2ReLU (that layer without its kernel: FLOTILLA_CONV_POOL_KERNEL=none) and ATen's
// conv2d, max-pool, ReLU; forward and the weights' backward, float32 and under bf16 autocast.
#include <ATen/autocast_mode.h>
#include <torch/torch.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <vector>

#include "timing.h"
#include "flotilla/kernels/choice.h"
#include "flotilla/kernels/conv_pool_relu.h"
#include "flotilla/kernels/max_pool_relu.h"

using flotilla::bench::median_ms;

int main(int argc, char** argv) {
  flotilla::kernels::set_mode(flotilla::kernels::Mode::kFixed); // each kernel, not a measured choice
  const auto [repeats, images] = flotilla::bench::layer_bench(argc, argv, 256, false);
  using Layer = std::function<torch::Tensor(const torch::Tensor&)>;
  const Layer fused = [](const torch::Tensor& x) { return flotilla::kernels::max_pool2_relu(x); };
  const Layer pool_relu = [](const torch::Tensor& x) {
    return torch::relu(torch::max_pool2d(x, 2));
  };
  const Layer relu_pool = [](const torch::Tensor& x) {
    return torch::max_pool2d(torch::relu(x), 2);
  };
  for (const auto dtype : {torch::kFloat32, torch::kBFloat16}) {
    for (const auto& shape : {std::vector<std::int64_t>{images, 32, 28, 28},
                              std::vector<std::int64_t>{images, 64, 14, 14}}) {
      const auto cl = torch::MemoryFormat::ChannelsLast;
      const torch::Tensor x = torch::randn(shape).to(dtype).contiguous(cl);
      const torch::Tensor grad =
          torch::randn({shape[0], shape[1], shape[2] / 2, shape[3] / 2}).to(dtype).contiguous(cl);
      const auto time = [&](const Layer& layer) {
        return median_ms(repeats, [&] {
          const torch::Tensor in = x.detach().requires_grad_();
          layer(in).backward(grad);
        });
      };
      const double f = time(fused), pr = time(pool_relu), rp = time(relu_pool);
      std::printf("{\"bench\":\"max_pool_relu\",\"dtype\":\"%s\",\"shape\":[%lld,%lld,%lld,%lld],"
                  "\"memory_format\":\"channels_last\",\"threads\":1,\"repeats\":%d,"
                  "\"metric\":\"forward_backward_ms\",\"fused\":%.3f,\"aten_pool_relu\":%.3f,"
                  "\"aten_relu_pool\":%.3f,\"ratio_vs_pool_relu\":%.3f,"
                  "\"ratio_vs_relu_pool\":%.3f}\n",
                  dtype == torch::kFloat32 ? "float32" : "bfloat16",
                  static_cast<long long>(shape[0]), static_cast<long long>(shape[1]),
                  static_cast<long long>(shape[2]), static_cast<long long>(shape[3]), repeats, f,
                  pr, rp, pr / f, rp / f);
    }
  }

  // The first layer as compile() keeps it: one-channel images and the weight with NHWC strides.
  const auto nhwc = [](const torch::Tensor& t) {
    const auto s = t.sizes();
    return torch::empty_strided(s, {s[1] * s[2] * s[3], 1, s[3] * s[1], s[1]}, t.options())
        .copy_(t);
  };
  const std::string best = flotilla::kernels::conv_max_pool2_relu_kernel();
  flotilla::kernels::ConvMaxPool2ReLU layer(32);
  layer->weight.set_data(nhwc(layer->weight.detach()));
  const torch::Tensor batch = nhwc(torch::randn({images, 1, 28, 28}));
  const torch::Tensor grad =
      nhwc(torch::randn({images, 32, 14, 14})).contiguous(torch::MemoryFormat::ChannelsLast);
  for (const bool bf16 : {false, true}) {
    // The output's gradient in the output's type, made outside the timed runs.
    const torch::Tensor grad_out = grad.to(bf16 ? torch::kBFloat16 : torch::kFloat32);
    const auto time = [&](const std::function<torch::Tensor()>& forward) {
      return median_ms(repeats, [&] {
        at::autocast::set_autocast_enabled(at::kCPU, bf16);
        at::autocast::set_autocast_dtype(at::kCPU, at::kBFloat16);
        const torch::Tensor y = forward();
        at::autocast::set_autocast_enabled(at::kCPU, false);
        at::autocast::clear_cache();
        y.backward(grad_out);
        layer->weight.mutable_grad().reset();
        layer->bias.mutable_grad().reset();
      });
    };
    flotilla::kernels::use_conv_max_pool2_relu_kernel(best);
    const double fused = time([&] { return layer->forward(batch); });
    flotilla::kernels::use_conv_max_pool2_relu_kernel("none");
    const double unfused = time([&] { return layer->forward(batch); });
    flotilla::kernels::use_conv_max_pool2_relu_kernel(best);
    const double aten = time([&] {
      return torch::relu(
          torch::max_pool2d(torch::conv2d(batch, layer->weight, layer->bias, 1, 1), 2));
    });
    std::printf("{\"bench\":\"conv_max_pool_relu\",\"dtype\":\"%s\",\"shape\":[%lld,1,28,28],"
                "\"out_channels\":32,\"memory_format\":\"channels_last\",\"threads\":1,"
                "\"repeats\":%d,\"metric\":\"forward_backward_ms\",\"kernel\":\"%s\","
                "\"fused\":%.3f,\"conv_then_max_pool_relu\":%.3f,\"aten_conv_pool_relu\":%.3f,"
                "\"ratio_vs_conv_then_max_pool_relu\":%.3f,\"ratio_vs_aten\":%.3f}\n",
                bf16 ? "bfloat16 (autocast)" : "float32", static_cast<long long>(images), repeats,
                best.c_str(), fused, unfused, aten, unfused / fused, aten / fused);
  }
  return 0;
}
