#include "flotilla/profile/compute.h"

#include <ATen/record_function.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <string>
#include <vector>

namespace flotilla::profile {

namespace {

std::vector<std::int64_t> sizes_of(const c10::IValue& value) {
  if (!value.isTensor()) return {};
  const auto sizes = value.toTensor().sizes();
  return {sizes.begin(), sizes.end()};
}

std::int64_t product(const std::vector<std::int64_t>& v, std::size_t from = 0) {
  std::int64_t p = 1;
  for (std::size_t i = from; i < v.size(); ++i) p *= v[i];
  return p;
}

std::vector<std::int64_t> ints(const c10::IValue& value, std::size_t n) {
  std::vector<std::int64_t> out =
      value.isIntList() ? value.toIntVector() : std::vector<std::int64_t>{};
  if (out.size() == 1) out.assign(n, out.front());
  out.resize(n, 0);
  return out;
}

// Multiply-adds count 2. Only the kernels that do the products: a composite above them
// (conv2d, linear, matmul) is not counted again.
double flops_of(const std::string& name, c10::ArrayRef<const c10::IValue> in) {
  if ((name == "aten::mm" || name == "aten::bmm") && in.size() >= 2) {
    const auto a = sizes_of(in[0]), b = sizes_of(in[1]);
    if (a.size() < 2 || b.empty()) return 0;
    return 2.0 * static_cast<double>(product(a)) * static_cast<double>(b.back());
  }
  if ((name == "aten::addmm" || name == "aten::baddbmm") && in.size() >= 3) {
    const auto a = sizes_of(in[1]), b = sizes_of(in[2]);
    if (a.size() < 2 || b.empty()) return 0;
    return 2.0 * static_cast<double>(product(a)) * static_cast<double>(b.back());
  }
  // flotilla's fused kernels (flotilla/kernels/conv_pool_relu.h, winograd.h) announce their convolution as
  // flotilla::convolution, with aten::convolution's arguments.
  if ((name == "aten::convolution" || name == "flotilla::convolution") && in.size() >= 9) {
    // input [N, C, spatial...], weight [O, C/groups, kernel...]
    const auto x = sizes_of(in[0]), w = sizes_of(in[1]);
    if (x.size() < 3 || w.size() != x.size()) return 0;
    const std::size_t dims = x.size() - 2;
    const auto stride = ints(in[3], dims), padding = ints(in[4], dims),
               dilation = ints(in[5], dims);
    const bool transposed = in[6].isBool() && in[6].toBool();
    // Each output position of a convolution (each input position of a transposed one) takes
    // weight-size multiply-adds per output channel group.
    double positions = static_cast<double>(x[0]);
    for (std::size_t d = 0; d < dims; ++d) {
      const std::int64_t size =
          transposed ? x[2 + d]
                     : (x[2 + d] + 2 * padding[d] - dilation[d] * (w[2 + d] - 1) - 1) /
                               std::max<std::int64_t>(stride[d], 1) +
                           1;
      positions *= static_cast<double>(std::max<std::int64_t>(size, 0));
    }
    return 2.0 * positions * static_cast<double>(product(w));
  }
  if (name.rfind("aten::_scaled_dot_product_", 0) == 0 && in.size() >= 3) {
    // q [..., L, E], k [..., S, E], v [..., S, Ev]: Q K^T then the weights times V.
    const auto q = sizes_of(in[0]), k = sizes_of(in[1]), v = sizes_of(in[2]);
    if (q.size() < 2 || k.size() < 2 || v.empty()) return 0;
    const double rows = static_cast<double>(product(q)) / static_cast<double>(q.back());
    const double s = static_cast<double>(k[k.size() - 2]);
    return 2.0 * rows * s * static_cast<double>(q.back() + v.back());
  }
  return 0;
}

thread_local double* counting = nullptr;
// Counted operators open on this thread: one inside another (autocast's wrapper calling the
// same operator again, a math attention calling bmm) is the same work, counted once.
thread_local int counted_open = 0;

struct Counted : at::ObserverContext {};

} // namespace

double counted_flops(const std::function<void()>& run) {
  double total = 0;
  counting = &total;
  counted_open = 0;
  const at::CallbackHandle handle = at::addThreadLocalCallback(
      at::RecordFunctionCallback(
          [](const at::RecordFunction& fn) -> std::unique_ptr<at::ObserverContext> {
            if (!counting) return nullptr;
            const double flops = flops_of(fn.name(), fn.inputs());
            if (flops == 0) return nullptr;
            if (counted_open++ == 0) *counting += flops;
            return std::make_unique<Counted>();
          },
          [](const at::RecordFunction&, at::ObserverContext* context) {
            if (context) --counted_open;
          })
          .needsInputs(true));
  auto stop = [&] {
    at::removeCallback(handle);
    counting = nullptr;
    counted_open = 0;
  };
  try {
    run();
  } catch (...) {
    stop();
    throw;
  }
  stop();
  return total;
}

double matmul_peak_gflops(c10::ScalarType dtype) {
  torch::NoGradGuard no_grad;
  const auto options = torch::TensorOptions().dtype(dtype);
  const torch::Tensor a = torch::randn({1024, 1024}, options);
  const torch::Tensor b = torch::randn({1024, 1024}, options);
  for (int i = 0; i < 3; ++i) torch::mm(a, b);
  std::vector<double> seconds;
  for (int i = 0; i < 7; ++i) {
    const auto start = std::chrono::steady_clock::now();
    torch::mm(a, b);
    seconds.push_back(
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  std::sort(seconds.begin(), seconds.end());
  return 2.0 * 1024 * 1024 * 1024 / seconds[3] / 1e9;
}

} // namespace flotilla::profile
