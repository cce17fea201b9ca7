// `build/bench_dropout [REPEATS=15] [IMAGES=64] | bench/machine.sh --tag`: ViT-tiny's dropout
// (p = 0.1), training, forward and backward, one thread: flotilla's hash_dropout
// (flotilla/kernels/dropout.h) against torch::dropout (what it runs with FLOTILLA_DROPOUT_KERNEL=none,
// and what PyTorch's twin runs); then the MLP's GELU and dropout: gelu_dropout against GELU
// then either dropout. Shapes: the MLP's hidden layer and the residual stream at
// IMAGES images of 50 tokens (64: a worker's share of a global batch of 128). Prints one JSON
// line per dtype and shape: the median milliseconds of each over REPEATS runs (after 3
// untimed), and the ratio. Freed memory is kept, as `flotilla train` keeps it.
#include <torch/torch.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "timing.h"
#include "flotilla/kernels/choice.h"
#include "flotilla/kernels/dropout.h"

using flotilla::bench::median_ms;

int main(int argc, char** argv) {
  namespace kernels = flotilla::kernels;
  flotilla::kernels::set_mode(flotilla::kernels::Mode::kFixed); // each kernel, not a measured choice
  const auto [repeats, images] = flotilla::bench::layer_bench(argc, argv, 64, true);
  const std::string best = kernels::dropout_kernel();
  for (const auto dtype : {torch::kFloat32, torch::kBFloat16}) {
    for (const std::int64_t width : {768, 192}) {
      const std::vector<std::int64_t> shape = {images, 50, width};
      const torch::Tensor x = torch::randn(shape).to(dtype).requires_grad_();
      const torch::Tensor grad = torch::randn(shape).to(dtype);
      auto step = [&] {
        const torch::Tensor y = kernels::hash_dropout(x, 0.1, true);
        torch::autograd::grad({y}, {x}, {grad});
      };
      kernels::use_dropout_kernel(best);
      const double hashed = median_ms(repeats, step);
      kernels::use_dropout_kernel("none");
      const double aten = median_ms(repeats, step);
      kernels::use_dropout_kernel(best);
      std::printf("{\"bench\":\"dropout\",\"dtype\":\"%s\",\"shape\":[%lld,50,%lld],\"p\":0.1,"
                  "\"threads\":1,\"repeats\":%d,\"metric\":\"forward_backward_ms\","
                  "\"kernel\":\"%s\",\"hashed\":%.3f,\"aten\":%.3f,\"ratio\":%.3f}\n",
                  dtype == torch::kFloat32 ? "float32" : "bfloat16",
                  static_cast<long long>(images), static_cast<long long>(width), repeats,
                  best.c_str(), hashed, aten, aten / hashed);
    }
  }
  // The MLP's GELU and the dropout after it: gelu_dropout (one pass each way) against ATen's
  // GELU then hash_dropout, and against ATen's GELU then ATen's dropout (PyTorch's twin).
  for (const auto dtype : {torch::kFloat32, torch::kBFloat16}) {
    const std::vector<std::int64_t> shape = {images, 50, 768};
    const torch::Tensor x = torch::randn(shape).to(dtype).requires_grad_();
    const torch::Tensor grad = torch::randn(shape).to(dtype);
    auto run = [&](auto layer) {
      return median_ms(repeats, [&] { torch::autograd::grad({layer()}, {x}, {grad}); });
    };
    kernels::use_dropout_kernel(best);
    const double fused = run([&] { return kernels::gelu_dropout(x, 0.1, true); });
    const double hashed = run([&] { return kernels::hash_dropout(torch::gelu(x), 0.1, true); });
    kernels::use_dropout_kernel("none");
    const double aten = run([&] { return kernels::hash_dropout(torch::gelu(x), 0.1, true); });
    kernels::use_dropout_kernel(best);
    std::printf("{\"bench\":\"gelu_dropout\",\"dtype\":\"%s\",\"shape\":[%lld,50,768],\"p\":0.1,"
                "\"threads\":1,\"repeats\":%d,\"metric\":\"forward_backward_ms\","
                "\"kernel\":\"%s\",\"fused\":%.3f,\"aten_gelu_then_hashed\":%.3f,"
                "\"aten\":%.3f,\"ratio\":%.3f,\"of\":\"aten/fused\"}\n",
                dtype == torch::kFloat32 ? "float32" : "bfloat16", static_cast<long long>(images),
                repeats, best.c_str(), fused, hashed, aten, aten / fused);
  }
  return 0;
}
