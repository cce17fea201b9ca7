#include "models/winograd.h"

#include <ATen/Parallel.h>
#include <ATen/autocast_mode.h>
#include <ATen/record_function.h>
#include <torch/autograd.h>
#include <torch/torch.h>

#include <algorithm>
#include <vector>

#include "models/cpu_kernels.h"
#include "models/winograd_kernel.h"

namespace flotilla::models {
namespace {

namespace kernel = winograd_kernels;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Past 256 channels in and out the transformed weights (36 x in x out floats, 37 MB at 512)
// no longer stay in cache between blocks of tiles: at 512 channels and 4x4 images the kernels
// took 1.6-2x oneDNN's time (bench/winograd.cpp).
constexpr std::int64_t kMaxChannels = 256;
// With bfloat16 activations oneDNN's direct convolution computes in bfloat16, twice float's
// rate: float Winograd is ahead of it to 64 channels (1.1-1.5x, bench/winograd.cpp), about
// level at 128 and 256 (1.06x and 0.97x at ResNet-18's 14x14 and 7x7, forward and both
// gradients).
constexpr std::int64_t kMaxChannelsBf16 = 64;
constexpr std::int64_t kLanes = 16; // the channels: a multiple of either kernel's vector
constexpr int kPositions = kernel::kPositions;
// Tile blocks whose weight gradients one partial sum holds: partial sums are added in order, so
// the gradient is the same for any number of threads.
constexpr std::int64_t kBlocksPerSum = 16;

CpuKernelChoice<kernel::Kernel>& choice() {
  static CpuKernelChoice<kernel::Kernel> choice("FLOTILLA_WINOGRAD_KERNEL", kernel::kAvx512,
                                                kernel::kAvx2);
  return choice;
}

// The transformed weights [36][in][out] of g, filters laid out [3][3][in][out].
torch::Tensor transformed(const kernel::Kernel& k, const torch::Tensor& g) {
  torch::Tensor u = torch::empty({kPositions, g.size(2), g.size(3)}, g.options());
  k.transform_weights(g.const_data_ptr<float>(), g.size(2), g.size(3), u.mutable_data_ptr<float>());
  return u;
}

kernel::Images images_of(const torch::Tensor& x) {
  const long h = x.size(2), w = x.size(3);
  kernel::Images im{};
  im.n = x.size(0);
  im.h = h;
  im.w = w;
  im.tiles_h = (h + 3) / 4;
  im.tiles_w = (w + 3) / 4;
  im.bf16 = x.scalar_type() == torch::kBFloat16;
  return im;
}

std::int64_t tiles_in(const kernel::Images& im) {
  return im.n * im.tiles_h * im.tiles_w;
}

// Tiles a block: enough to reuse each position's weights, few enough that the block's
// transformed tiles in and out stay in the core's cache (~0.5 MB), a multiple of 8.
std::int64_t block_tiles(std::int64_t in, std::int64_t out) {
  return std::max<std::int64_t>(8, std::min<std::int64_t>(128, 3500 / (in + out)) / 8 * 8);
}

// A thread's scratch of `floats`, kept for its next call.
float* scratch(std::size_t floats) {
  thread_local std::vector<float> buffer;
  if (buffer.size() < floats) buffer.resize(floats);
  return buffer.data();
}

// 36 positions of `tiles` tiles of `channels`, each position a little more than the last's end
// apart (36 streams exactly 4 KiB apart would share the same cache sets).
std::int64_t position_stride(std::int64_t tiles, std::int64_t channels) {
  return tiles * channels + 16;
}

// y [n][out][h][w] (channels-last) of x (channels-last) and the transformed weights u.
torch::Tensor winograd_forward(const kernel::Kernel& k, const torch::Tensor& x,
                               const torch::Tensor& u) {
  const std::int64_t in = x.size(1), out = u.size(2);
  torch::Tensor y = torch::empty({x.size(0), out, x.size(2), x.size(3)},
                                 x.options().memory_format(torch::MemoryFormat::ChannelsLast));
  const kernel::Images im = images_of(x);
  const std::int64_t tiles = tiles_in(im), block = block_tiles(in, out);
  const std::int64_t blocks = (tiles + block - 1) / block;
  const std::int64_t in_stride = position_stride(block, in),
                     out_stride = position_stride(block, out);
  const void* xs = x.const_data_ptr();
  const float* us = u.const_data_ptr<float>();
  void* ys = y.mutable_data_ptr();
  at::parallel_for(0, blocks, 1, [&](std::int64_t begin, std::int64_t end) {
    float* buffer = scratch(kPositions * (in_stride + out_stride));
    const kernel::Scratch in_tiles{buffer, in_stride};
    const kernel::Scratch out_tiles{buffer + kPositions * in_stride, out_stride};
    for (std::int64_t b = begin; b < end; ++b) {
      const std::int64_t first = b * block;
      k.forward(xs, in, im, us, out, first, std::min(block, tiles - first), in_tiles, out_tiles,
                ys);
    }
  });
  return y;
}

// The weight gradient [out][in][3][3] of y = conv(x, w) given gy (both channels-last).
torch::Tensor winograd_weight_gradient(const kernel::Kernel& k, const torch::Tensor& x,
                                       const torch::Tensor& gy, const torch::Tensor& w) {
  const std::int64_t in = x.size(1), out = gy.size(1);
  const kernel::Images im = images_of(x);
  const std::int64_t tiles = tiles_in(im), block = block_tiles(in, out);
  const std::int64_t blocks = (tiles + block - 1) / block;
  const std::int64_t sums = (blocks + kBlocksPerSum - 1) / kBlocksPerSum;
  const std::int64_t in_stride = position_stride(block, in),
                     grad_stride = position_stride(block, out);
  const auto floats = x.options().dtype(torch::kFloat);
  torch::Tensor partial = torch::zeros({sums, kPositions, in, out}, floats);
  const void* xs = x.const_data_ptr();
  const void* gys = gy.const_data_ptr();
  float* ps = partial.mutable_data_ptr<float>();
  at::parallel_for(0, sums, 1, [&](std::int64_t begin, std::int64_t end) {
    float* buffer = scratch(kPositions * (in_stride + grad_stride));
    const kernel::Scratch in_tiles{buffer, in_stride};
    const kernel::Scratch grad_tiles{buffer + kPositions * in_stride, grad_stride};
    for (std::int64_t s = begin; s < end; ++s) {
      for (std::int64_t b = s * kBlocksPerSum; b < std::min(blocks, (s + 1) * kBlocksPerSum); ++b) {
        const std::int64_t first = b * block;
        k.weight_gradient(xs, in, gys, out, im, first, std::min(block, tiles - first), in_tiles,
                          grad_tiles, ps + s * kPositions * in * out);
      }
    }
  });
  // Partial sums in order, then G^T s G, as [3][3][in][out].
  const torch::Tensor s = sums == 1 ? partial[0] : partial.sum(0);
  torch::Tensor g = torch::empty({3, 3, in, out}, floats);
  k.transform_back(s.const_data_ptr<float>(), in, out, g.mutable_data_ptr<float>());
  return g.permute({3, 2, 0, 1}).contiguous(w.suggest_memory_format());
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
    return winograd_forward(k, x, transformed(k, w.permute({2, 3, 1, 0}).contiguous()));
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const torch::Tensor &x = saved[0], &w = saved[1];
    const kernel::Kernel& k = choice().kernel_for_backward();
    const torch::Tensor gy = channels_last(grads[0], x.scalar_type());
    torch::Tensor gx, gw;
    if (ctx->needs_input_grad(0)) {
      // The input's gradient is the convolution of gy with the weights flipped and transposed.
      gx = winograd_forward(k, gy,
                            transformed(k, w.flip({2, 3}).permute({2, 3, 0, 1}).contiguous()));
    }
    if (ctx->needs_input_grad(1)) gw = winograd_weight_gradient(k, x, gy, w);
    return {gx, gw};
  }
};

bool is(const torch::ExpandingArray<2>& a, std::int64_t v) {
  return (*a)[0] == v && (*a)[1] == v;
}

// The type the kernels read x as where they apply to conv(x): float32, or under CPU autocast to
// bfloat16 bfloat16 (x cast as autocast casts a convolution's input); kUndefined where they do
// not apply.
torch::ScalarType activations_of(const torch::nn::Conv2dImpl& conv, const torch::Tensor& x) {
  constexpr auto kNone = torch::ScalarType::Undefined;
  const bool floating = x.scalar_type() == torch::kFloat || x.scalar_type() == torch::kBFloat16;
  torch::ScalarType type = kNone;
  if (!at::autocast::is_autocast_enabled(at::kCPU)) {
    if (x.scalar_type() == torch::kFloat) type = torch::kFloat;
  } else if (floating && at::autocast::get_autocast_dtype(at::kCPU) == torch::kBFloat16) {
    type = torch::kBFloat16;
  }
  const auto& o = conv.options;
  const auto* padding = std::get_if<torch::ExpandingArray<2>>(&o.padding());
  const torch::Tensor& w = conv.weight;
  const std::int64_t most = type == torch::kBFloat16 ? kMaxChannelsBf16 : kMaxChannels;
  const bool applies = choice().kernel() != nullptr && type != kNone && x.device().is_cpu() &&
                       x.dim() == 4 && w.scalar_type() == torch::kFloat && is(o.kernel_size(), 3) &&
                       is(o.stride(), 1) && padding != nullptr && is(*padding, 1) &&
                       is(o.dilation(), 1) && o.groups() == 1 && !o.transposed() && !o.bias() &&
                       std::holds_alternative<torch::enumtype::kZeros>(o.padding_mode()) &&
                       x.size(1) == w.size(1) && x.size(1) % kLanes == 0 &&
                       w.size(0) % kLanes == 0 && x.size(1) <= most && w.size(0) <= most &&
                       x.numel() > 0 && x.is_contiguous(torch::MemoryFormat::ChannelsLast);
  return applies ? type : kNone;
}

} // namespace

bool runs_winograd(const torch::nn::Conv2dImpl& conv, const torch::Tensor& x) {
  return activations_of(conv, x) != torch::ScalarType::Undefined;
}

torch::Tensor conv3x3(torch::nn::Conv2dImpl& conv, const torch::Tensor& x) {
  const torch::ScalarType type = activations_of(conv, x);
  if (type == torch::ScalarType::Undefined) return conv.forward(x);
  // Under autocast x is cast as autocast casts it (a float32 input to bfloat16); the weights stay
  // float32, as the arithmetic is.
  const torch::Tensor input =
      x.scalar_type() == type ? x : at::autocast::cached_cast(type, x, at::kCPU);
  // The FLOP counter (profile::counted_flops) counts it as the convolution it computes.
  RECORD_FUNCTION("flotilla::convolution",
                  std::vector<c10::IValue>(
                      {input, conv.weight, torch::Tensor(), std::vector<std::int64_t>{1, 1},
                       std::vector<std::int64_t>{1, 1}, std::vector<std::int64_t>{1, 1}, false,
                       std::vector<std::int64_t>{0, 0}, 1}));
  return WinogradConvFunction::apply(input, conv.weight);
}

const char* winograd_kernel() {
  return choice().name();
}

bool use_winograd_kernel(const std::string& name) {
  return choice().use(name);
}

} // namespace flotilla::models
