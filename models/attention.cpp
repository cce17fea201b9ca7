#include "models/attention.h"

#include <ATen/ATen.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

#include <cmath>

namespace flotilla::models {

torch::Tensor attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v) {
  const std::int64_t n = q.size(0), h = q.size(1), l = q.size(2), d = q.size(3);
  if (!q.device().is_cpu()) {
    return at::scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape({n, l, h * d});
  }
  const c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::DispatchKey::AutocastCPU);
  const auto batched = [&](const torch::Tensor& t) { return t.reshape({n * h, l, d}); };
  const torch::Tensor keys = batched(k).transpose(1, 2);
  const torch::Tensor scores = at::baddbmm(at::zeros({}, keys.options()), batched(q), keys,
                                           /*beta=*/0, /*alpha=*/1.0 / std::sqrt(double(d)));
  const torch::Tensor heads = at::bmm(at::_softmax(scores, -1, false), batched(v));
  return heads.view({n, h, l, d}).transpose(1, 2).reshape({n, l, h * d});
}

} // namespace flotilla::models
