#include "flotilla/kernels/max_pool_relu.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <torch/autograd.h>
#include <torch/torch.h>

#include <cstdint>
#include <cstring>
#include <string>

#include "flotilla/error.h"
#include "kernels/measure.h"

namespace flotilla::kernels {
namespace {

// Per output: the window position (0 top left, 1 top right, 2 bottom left, 3 bottom right) of
// its maximum, or kNoGradient where the output is zero (ReLU passes no gradient).
constexpr std::uint8_t kNoGradient = 4;

// An element as stored (float, or bfloat16's bits) and its value as a float. The loops select
// stored elements, never convert back: every output is one of its inputs, or zero.
// The backward moves gradients as bits: `Bits` and the sign bit.
struct Float32 {
  using Stored = float;
  using Bits = std::uint32_t;
  static constexpr Bits kSign = 0x80000000u;
  static float value(float v) { return v; }
};
struct BFloat16 {
  using Stored = std::uint16_t;
  using Bits = std::uint16_t;
  static constexpr Bits kSign = 0x8000u;
  static float value(std::uint16_t bits) {
    const std::uint32_t wide = static_cast<std::uint32_t>(bits) << 16;
    float v;
    std::memcpy(&v, &wide, sizeof v);
    return v;
  }
};

// A run of `n` outputs whose windows' top-left inputs are `next` apart (channels-last: 1, the
// channels; NCHW: 2, along a row), each window's other inputs `right` and `down` from it.
// Branch-free, so the compiler vectorizes it.
template <class E, int Next>
inline void forward_run(const typename E::Stored* __restrict in, std::int64_t right,
                        std::int64_t down, typename E::Stored* __restrict y,
                        std::uint8_t* __restrict code, std::int64_t n) {
  using S = typename E::Stored;
  const S* __restrict q1 = in + right;
  const S* __restrict q2 = in + down;
  const S* __restrict q3 = in + down + right;
  for (std::int64_t i = 0; i < n; ++i) {
    // As PyTorch's max-pooling: the first largest in row order, and a NaN wins.
    const S e0 = in[i * Next], e1 = q1[i * Next], e2 = q2[i * Next], e3 = q3[i * Next];
    float m = E::value(e0);
    S best = e0;
    int at = 0;
    const float v1 = E::value(e1);
    const bool s1 = (v1 > m) | (v1 != v1);
    m = s1 ? v1 : m, best = s1 ? e1 : best, at = s1 ? 1 : at;
    const float v2 = E::value(e2);
    const bool s2 = (v2 > m) | (v2 != v2);
    m = s2 ? v2 : m, best = s2 ? e2 : best, at = s2 ? 2 : at;
    const float v3 = E::value(e3);
    const bool s3 = (v3 > m) | (v3 != v3);
    m = s3 ? v3 : m, best = s3 ? e3 : best, at = s3 ? 3 : at;
    // ReLU: NaN stays NaN and, as ReLU's backward (zero where the output is <= 0), passes its
    // gradient.
    const bool passes = !(m <= 0.0f);
    y[i] = passes ? best : S(0);
    code[i] = static_cast<std::uint8_t>(passes ? at : kNoGradient);
  }
}

// Masks, not branches or float arithmetic (a NaN or infinite gradient passes as it is).
template <class E, int Next>
inline void backward_run(const typename E::Bits* __restrict gy,
                         const std::uint8_t* __restrict code, std::int64_t right,
                         std::int64_t down, typename E::Bits* __restrict gx, std::int64_t n) {
  using B = typename E::Bits;
  B* __restrict q1 = gx + right;
  B* __restrict q2 = gx + down;
  B* __restrict q3 = gx + down + right;
  for (std::int64_t i = 0; i < n; ++i) {
    const B at = code[i];
    // +0 for -0: PyTorch's backward adds the gradient into zeros.
    const B g = gy[i] & static_cast<B>(-static_cast<B>(gy[i] != E::kSign));
    gx[i * Next] = g & static_cast<B>(-static_cast<B>(at == 0));
    q1[i * Next] = g & static_cast<B>(-static_cast<B>(at == 1));
    q2[i * Next] = g & static_cast<B>(-static_cast<B>(at == 2));
    q3[i * Next] = g & static_cast<B>(-static_cast<B>(at == 3));
  }
}

// Where the four inputs of each output are: outputs are visited in memory order, in rows of
// `runs` runs of `run` outputs (channels-last: a row is an output row of OW windows of C
// channels; NCHW: one output row of OW windows of one channel).
struct Walk {
  bool channels_last;
  std::int64_t rows, runs, run;
  std::int64_t oh, c, h, w;
  // The input offset of row r's first window's top-left element.
  std::int64_t input_row(std::int64_t r) const {
    const std::int64_t outer = r / oh, y = r % oh; // (n) or (n, c), then the output row
    return channels_last ? (outer * h + 2 * y) * w * c : (outer * h + 2 * y) * w;
  }
  std::int64_t right() const { return channels_last ? c : 1; }
  std::int64_t down() const { return channels_last ? w * c : w; }
  std::int64_t run_step() const { return channels_last ? 2 * c : 0; } // between runs of a row
};

Walk walk_of(torch::IntArrayRef input_sizes, bool channels_last) {
  const std::int64_t n = input_sizes[0], c = input_sizes[1], h = input_sizes[2],
                     w = input_sizes[3];
  const std::int64_t oh = h / 2, ow = w / 2;
  if (channels_last) return Walk{true, n * oh, ow, c, oh, c, h, w};
  return Walk{false, n * c * oh, 1, ow, oh, c, h, w};
}

constexpr std::int64_t kGrainRows = 16;

// Calls run(input offset, output offset) for every run of outputs, rows split among threads.
template <class Run>
void for_each_run(const Walk& k, Run&& run) {
  at::parallel_for(0, k.rows, kGrainRows, [&](std::int64_t begin, std::int64_t end) {
    for (std::int64_t r = begin; r < end; ++r) {
      for (std::int64_t j = 0; j < k.runs; ++j) {
        run(k.input_row(r) + j * k.run_step(), (r * k.runs + j) * k.run);
      }
    }
  });
}

template <class E>
void pool_forward(const typename E::Stored* x, typename E::Stored* y, std::uint8_t* code,
                  const Walk& k) {
  for_each_run(k, [&](std::int64_t in, std::int64_t out) {
    if (k.channels_last) {
      forward_run<E, 1>(x + in, k.right(), k.down(), y + out, code + out, k.run);
    } else {
      forward_run<E, 2>(x + in, k.right(), k.down(), y + out, code + out, k.run);
    }
  });
}

template <class E>
void pool_backward(const typename E::Bits* gy, const std::uint8_t* code, typename E::Bits* gx,
                   const Walk& k) {
  for_each_run(k, [&](std::int64_t in, std::int64_t out) {
    if (k.channels_last) {
      backward_run<E, 1>(gy + out, code + out, k.right(), k.down(), gx + in, k.run);
    } else {
      backward_run<E, 2>(gy + out, code + out, k.right(), k.down(), gx + in, k.run);
    }
  });
}

// The element type's kernel: float32 or bfloat16 (the others run ATen's two operations).
template <class F>
void dispatch(torch::ScalarType type, F&& f) {
  if (type == torch::kFloat32) {
    f(Float32{});
  } else {
    f(BFloat16{});
  }
}

bool has_kernel(torch::ScalarType type) {
  return type == torch::kFloat32 || type == torch::kBFloat16;
}

torch::MemoryFormat format_of(const torch::Tensor& x) {
  return x.suggest_memory_format() == torch::MemoryFormat::ChannelsLast
             ? torch::MemoryFormat::ChannelsLast
             : torch::MemoryFormat::Contiguous;
}

void check_input(const torch::Tensor& x) {
  if (x.dim() != 4 || x.size(2) < 2 || x.size(3) < 2) {
    throw ConfigError("MaxPool2ReLU takes [N, C, H, W] images of at least 2×2; got a tensor of "
                      "shape " + std::string(c10::str(x.sizes())) +
                      " (pool before the images get that small, or flatten them)");
  }
}

// A tensor's elements as T (the kernels' Stored or Bits view of its dtype).
template <class T>
T* elements(torch::Tensor& t) {
  return reinterpret_cast<T*>(t.data_ptr());
}
template <class T>
const T* elements(const torch::Tensor& t) {
  return reinterpret_cast<const T*>(t.const_data_ptr());
}

// The output and, per output, its code.
std::pair<torch::Tensor, torch::Tensor> forward_cpu(const torch::Tensor& input) {
  const auto format = format_of(input);
  const torch::Tensor x = input.contiguous(format);
  const std::vector<std::int64_t> shape = {x.size(0), x.size(1), x.size(2) / 2, x.size(3) / 2};
  torch::Tensor y = torch::empty(shape, x.options().memory_format(format));
  torch::Tensor code =
      torch::empty(shape, x.options().dtype(torch::kUInt8).memory_format(format));
  const Walk walk = walk_of(x.sizes(), format == torch::MemoryFormat::ChannelsLast);
  dispatch(x.scalar_type(), [&](auto e) {
    using E = decltype(e);
    using S = typename E::Stored;
    pool_forward<E>(elements<S>(x), elements<S>(y), code.mutable_data_ptr<std::uint8_t>(), walk);
  });
  return {y, code};
}

class MaxPool2ReLUFunction : public torch::autograd::Function<MaxPool2ReLUFunction> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x) {
    auto [y, code] = forward_cpu(x);
    ctx->save_for_backward({code});
    ctx->saved_data["input_sizes"] = x.sizes().vec();
    return y;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const torch::Tensor code = ctx->get_saved_variables()[0];
    const auto sizes = ctx->saved_data["input_sizes"].toIntVector();
    const auto format = format_of(code);
    const torch::Tensor gy = grads[0].contiguous(format);
    // Every gradient of a full window is written once; a row or column an odd size leaves out
    // of every window gets zeros (torch::zeros would drop the memory format).
    torch::Tensor gx = torch::empty(sizes, gy.options().memory_format(format));
    if (sizes[2] % 2 || sizes[3] % 2) gx.zero_();
    const Walk walk = walk_of(sizes, format == torch::MemoryFormat::ChannelsLast);
    dispatch(gy.scalar_type(), [&](auto e) {
      using E = decltype(e);
      using B = typename E::Bits;
      pool_backward<E>(elements<B>(gy), code.const_data_ptr<std::uint8_t>(), elements<B>(gx), walk);
    });
    return {gx};
  }
};

torch::Tensor run_kernel(const torch::Tensor& x) {
  if (torch::GradMode::is_enabled() && x.requires_grad()) {
    return MaxPool2ReLUFunction::apply(x);
  }
  return forward_cpu(x).first;
}

detail::Candidates candidates(const torch::Tensor& x, bool training) {
  at::Generator generator = at::make_generator<at::CPUGeneratorImpl>(0x5eed);
  const torch::Tensor xs = torch::randn(x.sizes(), generator, x.options())
                               .contiguous(x.suggest_memory_format())
                               .requires_grad_(training);
  torch::Tensor gy;
  if (training) {
    gy = torch::randn({x.size(0), x.size(1), x.size(2) / 2, x.size(3) / 2}, generator, x.options())
             .contiguous(x.suggest_memory_format());
  }
  const auto run = [=](const torch::Tensor& y) {
    if (training) torch::autograd::grad({y}, {xs}, {gy});
  };
  return {[=] { run(run_kernel(xs)); }, [=] { run(torch::relu(torch::max_pool2d(xs, 2))); }};
}

} // namespace

torch::Tensor max_pool2_relu(const torch::Tensor& x) {
  check_input(x);
  if (!x.device().is_cpu() || !has_kernel(x.scalar_type())) {
    return torch::relu(torch::max_pool2d(x, 2));
  }
  const bool training = torch::GradMode::is_enabled() && x.requires_grad();
  const std::string key = detail::shape_text(x.sizes().vec()) +
                          (x.scalar_type() == torch::kBFloat16 ? " bf16" : " f32") +
                          (x.is_contiguous(torch::MemoryFormat::ChannelsLast) &&
                                   !x.is_contiguous()
                               ? " channels-last"
                               : "");
  if (!detail::use_flotilla("max_pool2_relu", key, training,
                            [&] { return candidates(x, training); })) {
    return torch::relu(torch::max_pool2d(x, 2));
  }
  return run_kernel(x);
}

} // namespace flotilla::kernels
