#include "flotilla/kernels/attention.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/autocast_mode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/torch.h>

#include <cmath>

#include "kernels/measure.h"

namespace flotilla::kernels {
namespace {

// Two batched matmuls and a softmax in the inputs' type.
torch::Tensor matmul_attention(const torch::Tensor& q, const torch::Tensor& k,
                               const torch::Tensor& v) {
  const std::int64_t n = q.size(0), h = q.size(1), l = q.size(2), d = q.size(3);
  const c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::DispatchKey::AutocastCPU);
  const auto batched = [&](const torch::Tensor& t) { return t.reshape({n * h, l, d}); };
  const torch::Tensor keys = batched(k).transpose(1, 2);
  const torch::Tensor scores = at::baddbmm(at::zeros({}, keys.options()), batched(q), keys,
                                           /*beta=*/0, /*alpha=*/1.0 / std::sqrt(double(d)));
  const torch::Tensor heads = at::bmm(at::_softmax(scores, -1, false), batched(v));
  return heads.view({n, h, l, d}).transpose(1, 2).reshape({n, l, h * d});
}

torch::Tensor aten_attention(const torch::Tensor& q, const torch::Tensor& k,
                             const torch::Tensor& v) {
  const std::int64_t n = q.size(0), h = q.size(1), l = q.size(2), d = q.size(3);
  return at::scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape({n, l, h * d});
}

detail::Candidates candidates(const torch::Tensor& q, bool training) {
  at::Generator generator = at::make_generator<at::CPUGeneratorImpl>(0x5eed);
  const auto random = [&] {
    return torch::randn(q.sizes(), generator, q.options()).requires_grad_(training);
  };
  const torch::Tensor qs = random(), ks = random(), vs = random();
  torch::Tensor gy;
  if (training) {
    gy = torch::randn({q.size(0), q.size(2), q.size(1) * q.size(3)}, generator, q.options());
  }
  const auto run = [=](const torch::Tensor& y) {
    if (training) torch::autograd::grad({y}, {qs, ks, vs}, {gy.to(y.scalar_type())});
  };
  return {[=] { run(matmul_attention(qs, ks, vs)); }, [=] { run(aten_attention(qs, ks, vs)); }};
}

} // namespace

torch::Tensor attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v) {
  if (!q.device().is_cpu() || q.dim() != 4) return aten_attention(q, k, v);
  const bool training = torch::GradMode::is_enabled() &&
                        (q.requires_grad() || k.requires_grad() || v.requires_grad());
  const std::string key = detail::shape_text(q.sizes().vec()) + " " +
                          c10::toString(q.scalar_type()) +
                          (at::autocast::is_autocast_enabled(at::kCPU) ? " autocast" : "");
  if (!detail::use_flotilla("attention", key, training,
                            [&] { return candidates(q, training); })) {
    return aten_attention(q, k, v);
  }
  return matmul_attention(q, k, v);
}

} // namespace flotilla::kernels
