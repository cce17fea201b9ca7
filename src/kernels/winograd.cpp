#include "flotilla/kernels/winograd.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <ATen/autocast_mode.h>
#include <ATen/record_function.h>
#include <torch/autograd.h>
#include <torch/torch.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "flotilla/error.h"
#include "flotilla/kernels/convolution.h"
#include "kernels/cpu.h"
#include "kernels/measure.h"
#include "kernels/winograd_kernel.h"

namespace flotilla::kernels {
namespace {

namespace kernel = winograd_kernels;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The channels in and out that the kernels take, in float32 and with bfloat16 activations: to
// ResNet-18's widest (512, its 4x4 stage), where they measured 2.2x oneDNN's direct convolution
// in float32 and 1.1x its bfloat16 one (bench/winograd.cpp). None wider was measured.
constexpr std::int64_t kMaxChannels = 512;
// Outputs a panel of transformed weights; the channel counts in and out must be multiples of it
// (and so of either kernel's vector).
constexpr std::int64_t kPanel = kernel::kPanel;
constexpr int kPositions = kernel::kPositions;
// Tile blocks whose weight gradients one partial sum holds: partial sums are added in order, so
// the gradient is the same for any number of threads.
constexpr std::int64_t kBlocksPerSum = 4;
// Tiles a block (a thread's unit of work). Each block transforms its tiles (36 x (in + out)
// floats a tile, 9.4 MB at 512 channels) and multiplies them by every position's weights; 64
// was ahead of 16 and 32, and level with 128, from 16 to 512 channels (bench/winograd.cpp).
constexpr std::int64_t kBlockTiles = 64;
// Up to this many weights (in x out) a forward transforms them all first (36 x in x out floats,
// 9.4 MB at 256 channels) for every block to read; past it, each block transforms one panel of
// 16 outputs at a time just before its products, so they never leave the core's cache. At 512
// channels that took 50.5 against 54.4 ms for the forward and both gradients; at 256, 44.2
// against 39.4 (bench/winograd.cpp, 64 images, one thread, bfloat16 activations).
constexpr std::int64_t kMostWeightsTransformedFirst = 256 * 256;

CpuKernelChoice<kernel::Kernel>& choice() {
  static CpuKernelChoice<kernel::Kernel> choice("FLOTILLA_WINOGRAD_KERNEL", kernel::kAvx512,
                                                kernel::kAvx2);
  return choice;
}

// A buffer of at least `floats` that the calling thread keeps for its next call. The weight
// gradient's partial sums (36 x in x out floats) pass 32 MB at 512 channels, beyond glibc's
// largest heap block: allocated per call, they were mapped and zeroed by the kernel every time.
// Which: 0 the transformed weights, 1 a thread's partial sum, 2 a thread's blocks' scratch, 3
// the partial sums transformed back, 4 the filters by panel.
template <int Which> float* kept(std::size_t floats) {
  thread_local std::vector<float> buffer;
  if (buffer.size() < floats) buffer.resize(floats);
  return buffer.data();
}

kernel::Images images_of(const torch::Tensor& x) {
  return {x.size(0), x.size(2), x.size(3), x.scalar_type() == torch::kBFloat16};
}

// The tiles of one size (kernel::Part) over the images, and where their blocks and partial sums
// fall among all parts'.
struct Planned {
  kernel::Part part;
  std::int64_t tiles, blocks, first_block, sums, first_sum;
  std::int64_t weights; // floats of the part's transformed weights or weight gradient sum
  const float* u;       // a forward's transformed weights, where they are transformed first
};

// The images' tiles by size: 4 x 4 outputs where 4 rows and 4 columns are left, and a last row
// and column of tiles as deep as what is left of the side (3, or 2 where 2 or 1 is): 22
// positions along a side of 14 where 4-deep tiles take 24. Each part in blocks of kBlockTiles.
std::vector<Planned> plan_of(const kernel::Images& im, std::int64_t in, std::int64_t out) {
  struct Band {
    int size;
    long first, count;
  };
  auto bands = [](long side) {
    std::vector<Band> b;
    if (side / 4 > 0) b.push_back({4, 0, side / 4});
    if (side % 4 != 0)
      b.push_back({static_cast<int>(std::max<long>(side % 4, 2)), side / 4 * 4, 1});
    return b;
  };
  std::vector<Planned> plan;
  std::int64_t blocks = 0, sums = 0;
  for (const Band& r : bands(im.h)) {
    for (const Band& c : bands(im.w)) {
      Planned p{};
      p.part = {r.size, c.size, r.first, c.first, r.count, c.count};
      p.tiles = im.n * r.count * c.count;
      p.blocks = (p.tiles + kBlockTiles - 1) / kBlockTiles;
      p.first_block = blocks;
      p.sums = (p.blocks + kBlocksPerSum - 1) / kBlocksPerSum;
      p.first_sum = sums;
      p.weights = p.part.positions() * in * out;
      blocks += p.blocks;
      sums += p.sums;
      plan.push_back(p);
    }
  }
  return plan;
}

// The part that holds block (or partial sum) `i` of all parts'.
const Planned& part_of(const std::vector<Planned>& plan, std::int64_t i, bool sum) {
  std::size_t p = 0;
  while (p + 1 < plan.size() && (sum ? plan[p + 1].first_sum : plan[p + 1].first_block) <= i) ++p;
  return plan[p];
}

// kPositions positions of `tiles` tiles of `channels`, each position a little more than the
// last's end apart (streams exactly 4 KiB apart would share the same cache sets).
std::int64_t position_stride(std::int64_t tiles, std::int64_t channels) {
  return tiles * channels + 16;
}

// y [n][out][h][w] (channels-last) of x (channels-last) and the filters g of `out` outputs
// (panels_of).
torch::Tensor winograd_forward(const kernel::Kernel& k, const torch::Tensor& x, const float* g,
                               std::int64_t out) {
  const std::int64_t in = x.size(1);
  torch::Tensor y = torch::empty({x.size(0), out, x.size(2), x.size(3)},
                                 x.options().memory_format(torch::MemoryFormat::ChannelsLast));
  const kernel::Images im = images_of(x);
  std::vector<Planned> plan = plan_of(im, in, out);
  const std::int64_t block = kBlockTiles, blocks = plan.back().first_block + plan.back().blocks;
  const std::int64_t in_stride = position_stride(block, in),
                     out_stride = position_stride(block, out);
  // A part of one block transforms its panels just before their products either way.
  const bool small = in * out <= kMostWeightsTransformedFirst;
  std::int64_t u_floats = 0;
  for (const Planned& p : plan) u_floats += small && p.blocks > 1 ? p.weights : 0;
  float* u = u_floats > 0 ? kept<0>(u_floats) : nullptr;
  for (Planned& p : plan) {
    if (small && p.blocks > 1) {
      k.transform_weights(g, in, out, p.part, u);
      p.u = u;
      u += p.weights;
    }
  }
  const std::int64_t panel_floats = kPositions * in * kPanel;
  const void* xs = x.const_data_ptr();
  void* ys = y.mutable_data_ptr();
  at::parallel_for(0, blocks, 1, [&](std::int64_t begin, std::int64_t end) {
    float* buffer = kept<2>(kPositions * (in_stride + out_stride) + panel_floats);
    const kernel::Scratch in_tiles{buffer, in_stride};
    const kernel::Scratch out_tiles{buffer + kPositions * in_stride, out_stride};
    for (std::int64_t b = begin; b < end; ++b) {
      const Planned& p = part_of(plan, b, false);
      const kernel::Weights weights{p.u, g, buffer + kPositions * (in_stride + out_stride)};
      const std::int64_t first = (b - p.first_block) * block;
      k.forward(xs, in, im, p.part, weights, out, first, std::min(block, p.tiles - first), in_tiles,
                out_tiles, ys);
    }
  });
  return y;
}

// The weight gradient [out][in][3][3] of y = conv(x, w) given gy (both channels-last).
torch::Tensor winograd_weight_gradient(const kernel::Kernel& k, const torch::Tensor& x,
                                       const torch::Tensor& gy, const torch::Tensor& w) {
  const std::int64_t in = x.size(1), out = gy.size(1);
  const kernel::Images im = images_of(x);
  const std::vector<Planned> plan = plan_of(im, in, out);
  const std::int64_t block = kBlockTiles, sums = plan.back().first_sum + plan.back().sums;
  const std::int64_t in_stride = position_stride(block, in),
                     grad_stride = position_stride(block, out);
  // Each partial sum is transformed back as soon as it is complete, from a buffer its thread
  // reuses (36 x in x out floats, 9.4 MB at 256 channels), into its own [out][3][3][in] (a
  // quarter of that or less); those are added in order. (Keeping every part's sums until the end
  // took 31.7 MB at 7x7 and 256 channels, past what stays in cache.)
  torch::Tensor g =
      torch::empty({out, in, 3, 3}, w.options().memory_format(torch::MemoryFormat::ChannelsLast));
  const std::int64_t filter_floats = 9 * in * out;
  float* gs = g.mutable_data_ptr<float>();
  float* sum_filters = sums > 1 ? kept<3>(sums * filter_floats) : gs;
  const void* xs = x.const_data_ptr();
  const void* gys = gy.const_data_ptr();
  at::parallel_for(0, sums, 1, [&](std::int64_t begin, std::int64_t end) {
    float* buffer = kept<2>(kPositions * (in_stride + grad_stride));
    const kernel::Scratch in_tiles{buffer, in_stride};
    const kernel::Scratch grad_tiles{buffer + kPositions * in_stride, grad_stride};
    float* sum = kept<1>(kPositions * in * out);
    for (std::int64_t s = begin; s < end; ++s) {
      const Planned& p = part_of(plan, s, true);
      const std::int64_t first_block = (s - p.first_sum) * kBlocksPerSum;
      for (std::int64_t b = first_block; b < std::min(p.blocks, first_block + kBlocksPerSum); ++b) {
        const std::int64_t first = b * block;
        k.weight_gradient(xs, in, gys, out, im, p.part, first, std::min(block, p.tiles - first),
                          in_tiles, grad_tiles, b > first_block, sum);
      }
      k.transform_back(sum, out, in, p.part, sum_filters + s * filter_floats);
    }
  });
  if (sums > 1) {
    std::memcpy(gs, sum_filters, filter_floats * sizeof(float));
    for (std::int64_t s = 1; s < sums; ++s) {
      const float* add = sum_filters + s * filter_floats;
      for (std::int64_t i = 0; i < filter_floats; ++i) gs[i] += add[i];
    }
  }
  return g.contiguous(w.suggest_memory_format());
}

// The filters of a forward by panels of 16 outputs, [out / 16][3][3][in][16], from a
// convolution's weights w [out][in][3][3]; `transposed`, those of its input's gradient: w flipped,
// with in and out swapped. (A permute and copy of 512x512x3x3 channels-last weights to
// [3][3][in][out] took 5.4 ms.) In a buffer the calling thread keeps, valid until its next call.
const float* panels_of(const torch::Tensor& w, bool transposed) {
  const torch::Tensor nhwc = w.contiguous(torch::MemoryFormat::ChannelsLast); // [out][3][3][in]
  const std::int64_t out = w.size(0), in = w.size(1);
  const std::int64_t rows = transposed ? out : in, panels = (transposed ? in : out) / kPanel;
  const float* from = nhwc.const_data_ptr<float>();
  float* to = kept<4>(panels * 9 * rows * kPanel);
  for (std::int64_t p = 0; p < panels; ++p) {
    for (std::int64_t f = 0; f < 9; ++f) {
      for (std::int64_t r = 0; r < rows; ++r) {
        float* panel_row = to + ((p * 9 + f) * rows + r) * kPanel;
        if (transposed) { // output channel r's filter value 8 - f, input channels p * 16 on
          std::memcpy(panel_row, from + (r * 9 + 8 - f) * in + p * kPanel, kPanel * sizeof(float));
        } else {
          for (std::int64_t j = 0; j < kPanel; ++j) {
            panel_row[j] = from[((p * kPanel + j) * 9 + f) * in + r];
          }
        }
      }
    }
  }
  return to;
}

// t as `type`, channels-last (itself where it is).
torch::Tensor channels_last(const torch::Tensor& t, torch::ScalarType type) {
  return t.to(type).contiguous(torch::MemoryFormat::ChannelsLast);
}

class WinogradConvFunction : public torch::autograd::Function<WinogradConvFunction> {
 public:
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x,
                               const torch::Tensor& w) {
    ctx->save_for_backward({x, w});
    const kernel::Kernel& k = *choice().kernel();
    return winograd_forward(k, x, panels_of(w, false), w.size(0));
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const torch::Tensor &x = saved[0], &w = saved[1];
    const kernel::Kernel& k = choice().kernel_for_backward();
    const torch::Tensor gy = channels_last(grads[0], x.scalar_type());
    torch::Tensor gx, gw;
    if (ctx->needs_input_grad(0)) {
      // The input's gradient is the convolution of gy with the weights flipped and transposed.
      gx = winograd_forward(k, gy, panels_of(w, true), w.size(1));
    }
    if (ctx->needs_input_grad(1)) gw = winograd_weight_gradient(k, x, gy, w);
    return {gx, gw};
  }
};

bool all(at::IntArrayRef values, std::int64_t v) {
  return !values.empty() && std::all_of(values.begin(), values.end(),
                                        [v](std::int64_t x) { return x == v; });
}

// The type the kernels read x as where they apply to conv2d(x, weight, ...): float32, or under
// CPU autocast to bfloat16 bfloat16 (x cast as autocast casts a convolution's input); kUndefined
// where they do not apply.
torch::ScalarType activations_of(const torch::Tensor& x, const torch::Tensor& w,
                                 const std::optional<torch::Tensor>& bias, at::IntArrayRef stride,
                                 at::IntArrayRef padding, at::IntArrayRef dilation,
                                 std::int64_t groups) {
  constexpr auto kNone = torch::ScalarType::Undefined;
  if (choice().kernel() == nullptr || !x.defined() || !w.defined()) return kNone;
  const bool floating = x.scalar_type() == torch::kFloat || x.scalar_type() == torch::kBFloat16;
  torch::ScalarType type = kNone;
  if (!at::autocast::is_autocast_enabled(at::kCPU)) {
    if (x.scalar_type() == torch::kFloat) type = torch::kFloat;
  } else if (floating && at::autocast::get_autocast_dtype(at::kCPU) == torch::kBFloat16) {
    type = torch::kBFloat16;
  }
  const bool applies = type != kNone && x.device().is_cpu() && w.device().is_cpu() &&
                       x.dim() == 4 && w.dim() == 4 && w.scalar_type() == torch::kFloat &&
                       w.size(2) == 3 && w.size(3) == 3 && all(stride, 1) && all(padding, 1) &&
                       all(dilation, 1) && groups == 1 && !(bias && bias->defined()) &&
                       x.size(1) == w.size(1) && x.size(1) % kPanel == 0 &&
                       w.size(0) % kPanel == 0 && x.size(1) <= kMaxChannels &&
                       w.size(0) <= kMaxChannels && x.numel() > 0 &&
                       x.is_contiguous(torch::MemoryFormat::ChannelsLast);
  return applies ? type : kNone;
}

// Winograd's convolution of x read as `type` (activations_of's).
torch::Tensor run_winograd(const torch::Tensor& x, const torch::Tensor& w, torch::ScalarType type) {
  // Under autocast x is cast as autocast casts it (a float32 input to bfloat16); the weights stay
  // float32, as the arithmetic is.
  const torch::Tensor input =
      x.scalar_type() == type ? x : at::autocast::cached_cast(type, x, at::kCPU);
  // The FLOP counter (profile::counted_flops) counts it as the convolution it computes.
  RECORD_FUNCTION("flotilla::convolution",
                  std::vector<c10::IValue>(
                      {input, w, torch::Tensor(), std::vector<std::int64_t>{1, 1},
                       std::vector<std::int64_t>{1, 1}, std::vector<std::int64_t>{1, 1}, false,
                       std::vector<std::int64_t>{0, 0}, 1}));
  return WinogradConvFunction::apply(input, w);
}

// Winograd's and oneDNN's runs on inputs of x's and w's shapes, types and layouts.
detail::Candidates candidates(const torch::Tensor& x, const torch::Tensor& w,
                              torch::ScalarType type, bool training) {
  at::Generator generator = at::make_generator<at::CPUGeneratorImpl>(0x5eed);
  const auto random = [&](const torch::Tensor& like, bool grad) {
    return torch::randn(like.sizes(), generator, like.options())
        .contiguous(like.suggest_memory_format())
        .requires_grad_(grad && training);
  };
  const torch::Tensor xs = random(x, x.requires_grad()), ws = random(w, w.requires_grad());
  torch::Tensor gy;
  if (training) {
    gy = torch::randn({x.size(0), w.size(0), x.size(2), x.size(3)}, generator,
                      x.options().dtype(type))
             .contiguous(torch::MemoryFormat::ChannelsLast);
  }
  const auto run = [=](const torch::Tensor& y) {
    if (!training) return;
    std::vector<torch::Tensor> inputs;
    for (const auto& t : {xs, ws}) {
      if (t.requires_grad()) inputs.push_back(t);
    }
    if (!inputs.empty()) torch::autograd::grad({y}, inputs, {gy.to(y.scalar_type())});
  };
  return {[=] { run(run_winograd(xs, ws, type)); },
          [=] { run(at::conv2d(xs, ws, {}, 1, 1, 1, 1)); }};
}

} // namespace

bool winograd_applies(const torch::Tensor& x, const torch::Tensor& weight,
                      const std::optional<torch::Tensor>& bias, at::IntArrayRef stride,
                      at::IntArrayRef padding, at::IntArrayRef dilation, std::int64_t groups) {
  return activations_of(x, weight, bias, stride, padding, dilation, groups) !=
         torch::ScalarType::Undefined;
}

namespace {
// A Conv2d's padding where it is at::conv2d's (zeros, given as numbers, not transposed); null
// where the module's own forward must run.
const torch::ExpandingArray<2>* plain_padding(const torch::nn::Conv2dImpl& conv) {
  const auto& o = conv.options;
  const auto* padding = std::get_if<torch::ExpandingArray<2>>(&o.padding());
  const bool zeros = std::holds_alternative<torch::enumtype::kZeros>(o.padding_mode());
  return padding != nullptr && zeros && !o.transposed() ? padding : nullptr;
}
} // namespace

bool winograd_applies(const torch::nn::Conv2dImpl& conv, const torch::Tensor& x) {
  const auto& o = conv.options;
  const auto* padding = plain_padding(conv);
  return padding != nullptr && winograd_applies(x, conv.weight, conv.bias, *o.stride(), **padding,
                                                *o.dilation(), o.groups());
}

torch::Tensor winograd_conv3x3(const torch::Tensor& x, const torch::Tensor& weight) {
  const torch::ScalarType type = activations_of(x, weight, std::nullopt, {1, 1}, {1, 1}, {1, 1}, 1);
  if (type == torch::ScalarType::Undefined) {
    throw ConfigError("winograd_conv3x3: Winograd's kernels do not apply to input " +
                      c10::str(x.sizes()) + " " + c10::toString(x.scalar_type()) + " and weight " +
                      c10::str(weight.sizes()) + " " + c10::toString(weight.scalar_type()) +
                      " (see winograd_applies: a CPU kernel, channels-last float32 input or "
                      "bfloat16 autocast, channel counts multiples of 16 up to 512)");
  }
  return run_winograd(x, weight, type);
}

torch::Tensor conv2d(const torch::Tensor& x, const torch::Tensor& weight,
                     const std::optional<torch::Tensor>& bias, at::IntArrayRef stride,
                     at::IntArrayRef padding, at::IntArrayRef dilation, std::int64_t groups) {
  const torch::ScalarType type =
      activations_of(x, weight, bias, stride, padding, dilation, groups);
  if (type == torch::ScalarType::Undefined) {
    return detail::other_conv2d(x, weight, bias, stride, padding, dilation, groups);
  }
  const bool training =
      torch::GradMode::is_enabled() && (x.requires_grad() || weight.requires_grad());
  const std::string key = detail::shape_text(x.sizes().vec()) + ">" +
                          std::to_string(weight.size(0)) +
                          (type == torch::kBFloat16 ? " bf16" : " f32");
  if (!detail::use_flotilla("conv3x3", key, training,
                            [&] { return candidates(x, weight, type, training); })) {
    return at::conv2d(x, weight, bias, stride, padding, dilation, groups);
  }
  return run_winograd(x, weight, type);
}

torch::Tensor conv2d(torch::nn::Conv2dImpl& conv, const torch::Tensor& x) {
  const auto& o = conv.options;
  const auto* padding = plain_padding(conv);
  if (padding == nullptr) return conv.forward(x);
  const std::optional<torch::Tensor> bias =
      conv.bias.defined() ? std::optional<torch::Tensor>(conv.bias) : std::nullopt;
  return kernels::conv2d(x, conv.weight, bias, *o.stride(), **padding, *o.dilation(), o.groups());
}

const char* winograd_kernel() {
  return choice().name();
}

bool use_winograd_kernel(const std::string& name) {
  return choice().use(name);
}

} // namespace flotilla::kernels
