// `build/bench_attention [REPEATS=15] [IMAGES=64] | bench/machine.sh --tag`: one ViT-tiny block's
// attention (3 heads of 64 over 50 tokens), forward and backward, one thread: flotilla's
// kernels::attention against ATen's math attention (_scaled_dot_product_attention_math, which
// computes bfloat16 inputs in float32) and scaled_dot_product_attention (flash attention for the
// CPU), each from the QKV projection's output to [N, L, 192]. bfloat16 under bf16 autocast, as
// in training. Prints one JSON line per dtype: the median milliseconds over REPEATS runs (after
// 3 untimed) and the ratios.
#include <torch/torch.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>

#include "timing.h"
#include "flotilla/train/mixed_precision.h"
#include "flotilla/kernels/choice.h"
#include "flotilla/kernels/attention.h"

using flotilla::bench::median_ms;

int main(int argc, char** argv) {
  flotilla::kernels::set_mode(flotilla::kernels::Mode::kFixed); // each kernel, not a measured choice
  const auto [repeats, n] = flotilla::bench::layer_bench(argc, argv, 64, true);
  const std::int64_t l = 50, h = 3, d = 64;
  for (const auto dtype : {torch::kFloat32, torch::kBFloat16}) {
    const torch::Tensor qkv = torch::randn({n, l, 3, h, d}).to(dtype).requires_grad_();
    const torch::Tensor grad = torch::randn({n, l, h * d}).to(dtype);
    const auto heads = [&] { return qkv.permute({2, 0, 3, 1, 4}); };
    auto time = [&](auto f) {
      return median_ms(repeats, [&] {
        const flotilla::train::AutocastGuard autocast(
            dtype == torch::kBFloat16 ? flotilla::train::Policy::kMixedBFloat16
                                      : flotilla::train::Policy::kFloat32,
            torch::kCPU);
        const auto x = heads();
        torch::autograd::grad({f(x[0], x[1], x[2])}, {qkv}, {grad});
      });
    };
    const auto arranged = [&](const torch::Tensor& out) {
      return out.transpose(1, 2).reshape({n, l, h * d});
    };
    const double ours = time(flotilla::kernels::attention);
    const double math = time([&](const auto& q, const auto& k, const auto& v) {
      return arranged(std::get<0>(at::_scaled_dot_product_attention_math(q, k, v)));
    });
    const double sdpa = time([&](const auto& q, const auto& k, const auto& v) {
      return arranged(at::scaled_dot_product_attention(q, k, v));
    });
    std::printf("{\"bench\":\"attention\",\"dtype\":\"%s\",\"shape\":[%lld,%lld,%lld,%lld],"
                "\"threads\":1,\"repeats\":%d,\"metric\":\"forward_backward_ms\",\"flotilla\":%.3f,"
                "\"aten_math\":%.3f,\"aten_sdpa\":%.3f,\"ratio_math\":%.3f,\"ratio_sdpa\":%.3f,"
                "\"of\":\"aten/flotilla\"}\n",
                dtype == torch::kFloat32 ? "float32" : "bfloat16", static_cast<long long>(n),
                static_cast<long long>(h), static_cast<long long>(l), static_cast<long long>(d),
                repeats, ours, math, sdpa, math / ours, sdpa / ours);
  }
  return 0;
}
