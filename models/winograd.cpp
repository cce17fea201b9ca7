#include "models/winograd.h"

#include <ATen/Parallel.h>
#include <ATen/autocast_mode.h>
#include <ATen/record_function.h>
#include <torch/autograd.h>
#include <torch/torch.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "models/cpu_kernels.h"
#include "models/winograd_kernel.h"

namespace flotilla::models {
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
// Which: 0 the transformed weights, 1 the partial sums, 2 a thread's blocks' scratch.
template <int Which> float* kept(std::size_t floats) {
  thread_local std::vector<float> buffer;
  if (buffer.size() < floats) buffer.resize(floats);
  return buffer.data();
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

// 36 positions of `tiles` tiles of `channels`, each position a little more than the last's end
// apart (36 streams exactly 4 KiB apart would share the same cache sets).
std::int64_t position_stride(std::int64_t tiles, std::int64_t channels) {
  return tiles * channels + 16;
}

// y [n][out][h][w] (channels-last) of x (channels-last) and the filters g (panels_of).
torch::Tensor winograd_forward(const kernel::Kernel& k, const torch::Tensor& x,
                               const torch::Tensor& g) {
  const std::int64_t in = x.size(1), out = g.size(0) * kPanel;
  torch::Tensor y = torch::empty({x.size(0), out, x.size(2), x.size(3)},
                                 x.options().memory_format(torch::MemoryFormat::ChannelsLast));
  const kernel::Images im = images_of(x);
  const std::int64_t tiles = tiles_in(im), block = kBlockTiles;
  const std::int64_t blocks = (tiles + block - 1) / block;
  const std::int64_t in_stride = position_stride(block, in),
                     out_stride = position_stride(block, out);
  const bool all = in * out <= kMostWeightsTransformedFirst;
  const float* gs = g.const_data_ptr<float>();
  float* u = nullptr;
  if (all) {
    u = kept<0>(kPositions * in * out);
    k.transform_weights(gs, in, out, u);
  }
  const std::int64_t panel_floats = all ? 0 : kPositions * in * kPanel;
  const void* xs = x.const_data_ptr();
  void* ys = y.mutable_data_ptr();
  at::parallel_for(0, blocks, 1, [&](std::int64_t begin, std::int64_t end) {
    float* buffer = kept<2>(kPositions * (in_stride + out_stride) + panel_floats);
    const kernel::Scratch in_tiles{buffer, in_stride};
    const kernel::Scratch out_tiles{buffer + kPositions * in_stride, out_stride};
    const kernel::Weights weights{u, gs, buffer + kPositions * (in_stride + out_stride)};
    for (std::int64_t b = begin; b < end; ++b) {
      const std::int64_t first = b * block;
      k.forward(xs, in, im, weights, out, first, std::min(block, tiles - first), in_tiles,
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
  const std::int64_t tiles = tiles_in(im), block = kBlockTiles;
  const std::int64_t blocks = (tiles + block - 1) / block;
  const std::int64_t sums = (blocks + kBlocksPerSum - 1) / kBlocksPerSum;
  const std::int64_t in_stride = position_stride(block, in),
                     grad_stride = position_stride(block, out);
  const std::int64_t sum_floats = kPositions * in * out;
  float* partial = kept<1>(sums * sum_floats);
  const void* xs = x.const_data_ptr();
  const void* gys = gy.const_data_ptr();
  at::parallel_for(0, sums, 1, [&](std::int64_t begin, std::int64_t end) {
    float* buffer = kept<2>(kPositions * (in_stride + grad_stride));
    const kernel::Scratch in_tiles{buffer, in_stride};
    const kernel::Scratch grad_tiles{buffer + kPositions * in_stride, grad_stride};
    for (std::int64_t s = begin; s < end; ++s) {
      const std::int64_t first_block = s * kBlocksPerSum;
      for (std::int64_t b = first_block; b < std::min(blocks, first_block + kBlocksPerSum); ++b) {
        const std::int64_t first = b * block;
        k.weight_gradient(xs, in, gys, out, im, first, std::min(block, tiles - first), in_tiles,
                          grad_tiles, b > first_block, partial + s * sum_floats);
      }
    }
  });
  // Partial sums in order, then G^T s G, as [3][3][in][out].
  for (std::int64_t s = 1; s < sums; ++s) {
    const float* add = partial + s * sum_floats;
    for (std::int64_t i = 0; i < sum_floats; ++i) partial[i] += add[i];
  }
  torch::Tensor g =
      torch::empty({out, in, 3, 3}, w.options().memory_format(torch::MemoryFormat::ChannelsLast));
  k.transform_back(partial, out, in, g.mutable_data_ptr<float>());
  return g.contiguous(w.suggest_memory_format());
}

// The filters of a forward by panels of 16 outputs, [out / 16][3][3][in][16], from a
// convolution's weights w [out][in][3][3]; `transposed`, those of its input's gradient: w flipped,
// with in and out swapped. (A permute and copy of 512x512x3x3 channels-last weights to
// [3][3][in][out] took 5.4 ms.)
torch::Tensor panels_of(const torch::Tensor& w, bool transposed) {
  const torch::Tensor nhwc = w.contiguous(torch::MemoryFormat::ChannelsLast); // [out][3][3][in]
  const std::int64_t out = w.size(0), in = w.size(1);
  const std::int64_t rows = transposed ? out : in, panels = (transposed ? in : out) / kPanel;
  torch::Tensor g = torch::empty({panels, 9, rows, kPanel}, w.options());
  const float* from = nhwc.const_data_ptr<float>();
  float* to = g.mutable_data_ptr<float>();
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
  return g;
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
    return winograd_forward(k, x, panels_of(w, false));
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const torch::Tensor &x = saved[0], &w = saved[1];
    const kernel::Kernel& k = choice().kernel_for_backward();
    const torch::Tensor gy = channels_last(grads[0], x.scalar_type());
    torch::Tensor gx, gw;
    if (ctx->needs_input_grad(0)) {
      // The input's gradient is the convolution of gy with the weights flipped and transposed.
      gx = winograd_forward(k, gy, panels_of(w, true));
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
  const bool applies = choice().kernel() != nullptr && type != kNone && x.device().is_cpu() &&
                       x.dim() == 4 && w.scalar_type() == torch::kFloat && is(o.kernel_size(), 3) &&
                       is(o.stride(), 1) && padding != nullptr && is(*padding, 1) &&
                       is(o.dilation(), 1) && o.groups() == 1 && !o.transposed() && !o.bias() &&
                       std::holds_alternative<torch::enumtype::kZeros>(o.padding_mode()) &&
                       x.size(1) == w.size(1) && x.size(1) % kPanel == 0 &&
                       w.size(0) % kPanel == 0 && x.size(1) <= kMaxChannels &&
                       w.size(0) <= kMaxChannels && x.numel() > 0 &&
                       x.is_contiguous(torch::MemoryFormat::ChannelsLast);
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
