// The kernels of the Winograd 3x3 convolution (winograd.h): F(4x4, 3x3), stride 1, padding 1,
// over channels-last float32 images whose channel counts are multiples of 16. Each 4x4 block of
// outputs (a tile) is computed from the 6x6 block of inputs around it: the input tile is
// transformed (B^T d B), each of the 36 positions multiplies its [tiles x C] by the transformed
// weights' [C x K], and the products are transformed back (A^T m A). That is 36 products per 16
// outputs a channel pair where the direct convolution takes 144.
// This header includes no other, for the reason conv_pool_relu_kernel.h gives:
// winograd_kernel.inc is compiled once per instruction set into its own namespace.
#pragma once

namespace flotilla::models::winograd_kernels {

constexpr int kPositions = 36; // of a 6x6 transformed tile
// The transformed weights are kept in panels of 16 outputs, [out / 16][36][in][16], each
// panel contiguous: a product step reads its weights in order (rows `out` floats apart would
// fall on few cache sets), and a panel can be transformed just before its products.
constexpr int kPanel = 16;

// Images [n][h][w][channels]; tiles are numbered image by image, row by row, tiles_w a row.
// The images (x, y, gy below) are floats, or bfloat16 bits (`bf16`: read widened to float,
// written rounded to nearest even); weights and the arithmetic are float either way.
struct Images {
  long n, h, w;
  long tiles_h, tiles_w; // (h + 3) / 4, (w + 3) / 4
  bool bf16;
};

// Scratch for `count` tiles: transformed tiles [36][count][channels], each position
// `stride` floats from the last (a stride a little over count x channels keeps the 36 streams
// off the same cache sets).
struct Scratch {
  float* data;
  long stride;
};

// The weights of a forward: u, all panels transformed (transform_weights); or, where u is null,
// the filters g, each panel transformed into `panel` ([36][c][kPanel]) before its products, so
// the transformed weights never leave the core's cache (they are 4x g's size). Filters are laid
// out by panel too: g [k / kPanel][3][3][c][kPanel].
struct Weights {
  const float* u;
  const float* g;
  float* panel;
};

// y (channels k) of tiles [first, first + count) from x (channels c) and the weights. `in` and
// `out` hold count tiles of c and of k channels.
using Forward = void (*)(const void* x, long c, const Images& images, const Weights& w, long k,
                         long first, long count, Scratch in, Scratch out, void* y);
// Adds (or with `accumulate` false, writes), for tiles [first, first + count), the products of
// gy's transformed gradient tiles (k channels) and x's transformed input tiles (c channels) into
// s [36][k][c]: the weight gradient before its transform back (G^T s G).
using WeightGradient = void (*)(const void* x, long c, const void* gy, long k, const Images& images,
                                long first, long count, Scratch in, Scratch grad, bool accumulate,
                                float* s);

// u [out / kPanel][36][in][kPanel] = G g G^T of each filter of g [out / kPanel][3][3][in][kPanel].
using TransformWeights = void (*)(const float* g, long in, long out, float* u);
// g [out][3][3][in] (a convolution's channels-last weights) = G^T s G of each of s
// [36][out][in]: the weight gradient.
using TransformBack = void (*)(const float* s, long out, long in, float* g);

struct Kernel {
  Forward forward;
  WeightGradient weight_gradient;
  TransformWeights transform_weights;
  TransformBack transform_back;
};
extern const Kernel kAvx512; // x86-64-v4
extern const Kernel kAvx2;   // x86-64-v3

} // namespace flotilla::models::winograd_kernels
