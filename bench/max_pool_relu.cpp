// `build/bench_max_pool_relu [REPEATS=15] | bench/machine.sh --tag`: one "ReLU, max-pool 2" of a
// CNN, forward and backward, one thread, channels-last: flotilla's MaxPool2ReLU (models/
// max_pool_relu.h) against the same values from ATen's kernels in PyTorch's usual order (ReLU,
// then max-pool: what the twins of bench/peers run by default) and pooled first (max-pool, then
// ReLU: what pytorch-ddp-best runs). Shapes: the zoo CNN's two pooling layers at 256 images (a
// worker's share of a global batch of 512). Prints one JSON line per dtype and shape: the median
// milliseconds of each over REPEATS runs (after 3 untimed), and the ratios.
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <vector>

#include "models/max_pool_relu.h"

namespace {

double median_ms(int repeats, const std::function<void()>& f) {
  for (int i = 0; i < 3; ++i) f();
  std::vector<double> times;
  for (int i = 0; i < repeats; ++i) {
    const auto start = std::chrono::steady_clock::now();
    f();
    times.push_back(
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
            .count());
  }
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

} // namespace

int main(int argc, char** argv) {
  const int repeats = argc > 1 ? std::max(1, std::atoi(argv[1])) : 15;
  at::set_num_threads(1);
  using Layer = std::function<torch::Tensor(const torch::Tensor&)>;
  const Layer fused = [](const torch::Tensor& x) { return flotilla::models::max_pool2_relu(x); };
  const Layer pool_relu = [](const torch::Tensor& x) { return torch::relu(torch::max_pool2d(x, 2)); };
  const Layer relu_pool = [](const torch::Tensor& x) { return torch::max_pool2d(torch::relu(x), 2); };
  for (const auto dtype : {torch::kFloat32, torch::kBFloat16}) {
    for (const auto& shape : {std::vector<std::int64_t>{256, 32, 28, 28},
                              std::vector<std::int64_t>{256, 64, 14, 14}}) {
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
  return 0;
}
