#include "flotilla/kernels/dropout.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <torch/autograd.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdint>
#include <mutex>

#include "flotilla/error.h"
#include "kernels/cpu.h"
#include "kernels/dropout_kernel.h"
#include "kernels/measure.h"

namespace flotilla::kernels {
namespace {

namespace kernel = dropout_kernels;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

CpuKernelChoice<kernel::Kernel>& choice() {
  static CpuKernelChoice<kernel::Kernel> choice("FLOTILLA_DROPOUT_KERNEL", kernel::kAvx512, kernel::kAvx2);
  return choice;
}

// 64 random bits from LibTorch's default CPU generator (what torch::manual_seed seeds).
std::uint64_t draw_seed() {
  at::Generator generator = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(generator.mutex());
  return at::check_generator<at::CPUGeneratorImpl>(generator)->random64();
}

kernel::Mask mask_of(std::uint64_t seed, double p) {
  const double threshold = std::nearbyint(p * 4294967296.0);
  return {static_cast<unsigned>(seed), static_cast<unsigned>(seed >> 32),
          static_cast<unsigned>(std::min(threshold, 4294967295.0)),
          static_cast<float>(1.0 / (1.0 - p))};
}

// `in` (contiguous, float32 or bfloat16), or its GELU (`f` the kernel's gelu), times its mask.
torch::Tensor masked(kernel::Apply f, const torch::Tensor& in, const kernel::Mask& mask) {
  torch::Tensor out = torch::empty_like(in, torch::MemoryFormat::Contiguous);
  const bool bf16 = in.scalar_type() == torch::kBFloat16;
  const auto* x = static_cast<const char*>(in.const_data_ptr());
  auto* y = static_cast<char*>(out.mutable_data_ptr());
  const std::int64_t element = in.element_size();
  at::parallel_for(0, in.numel(), 1 << 15, [&](std::int64_t begin, std::int64_t end) {
    f(x + begin * element, y + begin * element, static_cast<long>(end - begin), bf16,
      static_cast<unsigned>(begin), mask);
  });
  return out;
}

class DropoutFunction : public torch::autograd::Function<DropoutFunction> {
 public:
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, std::int64_t seed,
                               double p) {
    ctx->saved_data["seed"] = seed;
    ctx->saved_data["p"] = p;
    return masked(choice().kernel()->apply, x, mask_of(static_cast<std::uint64_t>(seed), p));
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto seed = static_cast<std::uint64_t>(ctx->saved_data["seed"].toInt());
    const double p = ctx->saved_data["p"].toDouble();
    const torch::Tensor gy = grads[0].contiguous();
    if (gy.scalar_type() != torch::kFloat && gy.scalar_type() != torch::kBFloat16) {
      return {masked(choice().kernel_for_backward().apply, gy.to(torch::kFloat), mask_of(seed, p))
                  .to(gy.scalar_type()),
              torch::Tensor(), torch::Tensor()};
    }
    return {masked(choice().kernel_for_backward().apply, gy, mask_of(seed, p)), torch::Tensor(),
            torch::Tensor()};
  }
};

// GELU then dropout in one pass each way; saves the input (GELU's backward needs it) and the
// seed, not the mask.
class GeluDropoutFunction : public torch::autograd::Function<GeluDropoutFunction> {
 public:
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, std::int64_t seed,
                               double p) {
    ctx->save_for_backward({x});
    ctx->saved_data["seed"] = seed;
    ctx->saved_data["p"] = p;
    return masked(choice().kernel()->gelu, x, mask_of(static_cast<std::uint64_t>(seed), p));
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const torch::Tensor x = ctx->get_saved_variables()[0];
    const kernel::Mask mask = mask_of(static_cast<std::uint64_t>(ctx->saved_data["seed"].toInt()),
                                      ctx->saved_data["p"].toDouble());
    const torch::Tensor gy = grads[0].to(x.scalar_type()).contiguous();
    torch::Tensor gx = torch::empty_like(x);
    const bool bf16 = x.scalar_type() == torch::kBFloat16;
    const std::int64_t element = x.element_size();
    const auto* in = static_cast<const char*>(x.const_data_ptr());
    const auto* g = static_cast<const char*>(gy.const_data_ptr());
    auto* out = static_cast<char*>(gx.mutable_data_ptr());
    const kernel::Kernel& k = choice().kernel_for_backward();
    at::parallel_for(0, x.numel(), 1 << 15, [&](std::int64_t begin, std::int64_t end) {
      k.gelu_backward(in + begin * element, g + begin * element, out + begin * element,
                      static_cast<long>(end - begin), bf16, static_cast<unsigned>(begin), mask);
    });
    return {gx, torch::Tensor(), torch::Tensor()};
  }
};

// ATen's dropout as torch::dropout computes it on the CPU (a Bernoulli mask, scaled), drawing
// from `generator` instead of the default one: the ATen candidate a measurement times.
torch::Tensor aten_dropout(const torch::Tensor& x, double p, at::Generator& generator) {
  const torch::Tensor noise = at::empty_like(x).bernoulli_(1 - p, generator).div_(1 - p);
  return x * noise;
}

// Whether the kernel's run applies to x (a kernel, the CPU, float32 or bfloat16, contiguous).
bool applies(const torch::Tensor& x, double p) {
  return choice().kernel() != nullptr && x.device().is_cpu() && p >= 0 && p < 1 &&
         x.numel() < (1LL << 32) && x.is_contiguous() &&
         (x.scalar_type() == torch::kFloat || x.scalar_type() == torch::kBFloat16);
}

torch::Tensor run_dropout(const torch::Tensor& x, double p, std::uint64_t seed) {
  RECORD_FUNCTION("flotilla::dropout", std::vector<c10::IValue>({x}));
  if (torch::GradMode::is_enabled() && x.requires_grad()) {
    return DropoutFunction::apply(x, static_cast<std::int64_t>(seed), p);
  }
  return masked(choice().kernel()->apply, x, mask_of(seed, p));
}

torch::Tensor run_gelu_dropout(const torch::Tensor& x, double rate, std::uint64_t seed) {
  RECORD_FUNCTION("flotilla::gelu_dropout", std::vector<c10::IValue>({x}));
  if (torch::GradMode::is_enabled() && x.requires_grad()) {
    return GeluDropoutFunction::apply(x, static_cast<std::int64_t>(seed), rate);
  }
  return masked(choice().kernel()->gelu, x, mask_of(seed, rate));
}

// The kernel's and ATen's runs on an input of x's shape and type; `gelu`: GELU first.
detail::Candidates candidates(const torch::Tensor& x, double p, bool gelu, bool training) {
  auto generator = std::make_shared<at::Generator>(at::make_generator<at::CPUGeneratorImpl>(0x5eed));
  const torch::Tensor xs =
      torch::randn(x.sizes(), *generator, x.options()).contiguous().requires_grad_(training);
  torch::Tensor gy;
  if (training) gy = torch::randn(x.sizes(), *generator, x.options());
  const auto run = [=](const torch::Tensor& y) {
    if (training) torch::autograd::grad({y}, {xs}, {gy});
  };
  if (gelu) {
    return {[=] { run(run_gelu_dropout(xs, p, 1)); },
            [=] { run(aten_dropout(torch::gelu(xs), p, *generator)); }};
  }
  return {[=] { run(run_dropout(xs, p, 1)); }, [=] { run(aten_dropout(xs, p, *generator)); }};
}

bool chosen(const char* op, const torch::Tensor& x, double p, bool gelu) {
  const bool training = torch::GradMode::is_enabled() && x.requires_grad();
  const std::string key = detail::shape_text(x.sizes().vec()) +
                          (x.scalar_type() == torch::kBFloat16 ? " bf16" : " f32");
  return detail::use_flotilla(op, key, training,
                              [&] { return candidates(x, p, gelu, training); });
}

} // namespace

torch::Tensor gelu_dropout(const torch::Tensor& x, double p, bool training) {
  // Evaluation, or p = 0: every element kept, scaled by 1, and no draw from the generator.
  const bool drops = training && p > 0;
  if (!applies(x, p) || (drops && !chosen("gelu_dropout", x, p, true))) {
    return hash_dropout(torch::gelu(x), p, training);
  }
  if (!drops && !chosen("gelu", x, 0, true)) return torch::gelu(x);
  return run_gelu_dropout(x, drops ? p : 0, drops ? draw_seed() : 0);
}

torch::Tensor hash_dropout(const torch::Tensor& x, double p, bool training) {
  if (!training || p == 0 || x.numel() == 0) return x; // as torch::dropout
  if (!applies(x, p) || !chosen("dropout", x, p, false)) return torch::dropout(x, p, training);
  return run_dropout(x, p, draw_seed());
}

DropoutImpl::DropoutImpl(double p) : p(p) {
  if (!(p >= 0 && p <= 1)) {
    throw ConfigError("dropout probability " + std::to_string(p) +
                      " is not between 0 and 1 (the share of elements zeroed in training)");
  }
}

void DropoutImpl::pretty_print(std::ostream& stream) const {
  stream << "flotilla::kernels::Dropout(p=" << p << ")";
}

GeluDropoutImpl::GeluDropoutImpl(double p) : p(p) {
  if (!(p >= 0 && p <= 1)) {
    throw ConfigError("dropout probability " + std::to_string(p) +
                      " is not between 0 and 1 (the share of elements zeroed in training)");
  }
}

void GeluDropoutImpl::pretty_print(std::ostream& stream) const {
  stream << "flotilla::kernels::GeluDropout(p=" << p << ")";
}

const char* dropout_kernel() {
  return choice().name();
}

bool use_dropout_kernel(const std::string& name) {
  return choice().use(name);
}

} // namespace flotilla::kernels
