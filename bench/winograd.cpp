// `build/bench_winograd [REPEATS=15] [IMAGES=64] | bench/machine.sh --tag`: a ResNet's 3x3
// convolutions (stride 1, padding 1, no bias), channels-last, one thread, in float32 and under
// bfloat16 autocast (bfloat16 activations): flotilla's conv3x3 with the Winograd kernels
// (flotilla/kernels/winograd.h) against the module's forward, oneDNN's direct convolution (what it runs
// with FLOTILLA_WINOGRAD_KERNEL=none, and what PyTorch's twin runs; under autocast in bfloat16).
// Shapes: ResNet-20's three stages and ResNet-18's four at IMAGES images (64: a worker's share of a
// global batch of 128). Prints one JSON line per shape and part (forward; forward and the input's
// gradient; forward and the weight's gradient; forward and both gradients): the median
// milliseconds of each over REPEATS runs (after 3 untimed), and the ratio. Freed memory is kept, as
// `flotilla train` keeps it.
#include <torch/torch.h>

#include <cstdio>
#include <string>
#include <vector>

#include "flotilla/train/mixed_precision.h"
#include "flotilla/kernels/choice.h"
#include "flotilla/kernels/winograd.h"
#include "timing.h"

using flotilla::bench::median_ms;

int main(int argc, char** argv) {
  namespace kernels = flotilla::kernels;
  flotilla::kernels::set_mode(flotilla::kernels::Mode::kFixed); // each kernel, not a measured choice
  const auto [repeats, images] = flotilla::bench::layer_bench(argc, argv, 64, true);
  const std::string best = kernels::winograd_kernel();
  const auto cl = torch::MemoryFormat::ChannelsLast;
  for (const bool bf16 : {false, true}) {
    for (const auto& [channels, size] : {std::pair<std::int64_t, std::int64_t>{16, 28},
                                         {32, 14},
                                         {64, 7},
                                         {64, 28},
                                         {128, 14},
                                         {256, 7},
                                         {512, 4}}) {
      torch::nn::Conv2d conv(
          torch::nn::Conv2dOptions(channels, channels, 3).padding(1).bias(false));
      conv->weight.set_data(conv->weight.contiguous(cl));
      const std::vector<std::int64_t> shape = {images, channels, size, size};
      const auto dtype = bf16 ? torch::kBFloat16 : torch::kFloat;
      const torch::Tensor x = torch::randn(shape).to(dtype).contiguous(cl).requires_grad_();
      const torch::Tensor grad = torch::randn(shape).to(dtype).contiguous(cl);
      for (const std::string part : {"forward", "forward, input gradient",
                                     "forward, weight gradient", "forward, both gradients"}) {
        // Gradients returned, not accumulated into .grad (an add per step on either side).
        auto run = [&] {
          torch::Tensor y;
          {
            flotilla::train::AutocastGuard autocast(bf16 ? flotilla::train::Policy::kMixedBFloat16
                                                         : flotilla::train::Policy::kFloat32,
                                                    torch::kCPU);
            if (part == "forward") {
              torch::NoGradGuard no_grad;
              kernels::conv2d(*conv, x);
              return;
            }
            y = kernels::conv2d(*conv, x);
          }
          if (part == "forward, input gradient") {
            torch::autograd::grad({y}, {x}, {grad});
          } else if (part == "forward, weight gradient") {
            torch::autograd::grad({y}, {conv->weight}, {grad});
          } else {
            torch::autograd::grad({y}, {x, conv->weight}, {grad});
          }
        };
        kernels::use_winograd_kernel(best);
        const double winograd = median_ms(repeats, run);
        kernels::use_winograd_kernel("none");
        const double direct = median_ms(repeats, run);
        kernels::use_winograd_kernel(best);
        std::printf(
            "{\"bench\":\"winograd\",\"dtype\":\"%s\",\"shape\":[%lld,%lld,%lld,%lld],"
            "\"part\":\"%s\",\"memory_format\":\"channels_last\",\"threads\":1,\"repeats\":%d,"
            "\"metric\":\"ms\",\"kernel\":\"%s\",\"winograd\":%.3f,\"onednn_direct\":%.3f,"
            "\"ratio\":%.3f}\n",
            bf16 ? "bfloat16 activations (autocast)" : "float32", static_cast<long long>(images),
            static_cast<long long>(channels), static_cast<long long>(size),
            static_cast<long long>(size), part.c_str(), repeats, best.c_str(), winograd, direct,
            direct / winograd);
      }
    }
  }
  return 0;
}
