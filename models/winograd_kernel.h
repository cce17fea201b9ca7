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

// y (channels k) of tiles [first, first + count) from x (channels c) and u, the transformed
// weights [36][c][k] (transform_weights in winograd.cpp). `in` and `out` hold count tiles of c
// and of k channels.
using Forward = void (*)(const void* x, long c, const Images& images, const float* u, long k,
                         long first, long count, Scratch in, Scratch out, void* y);
// Adds, for tiles [first, first + count), the products of x's transformed input tiles (c
// channels) and gy's transformed gradient tiles (k channels) into s [36][c][k]: the weight
// gradient before its transform back (G^T s G).
using WeightGradient = void (*)(const void* x, long c, const void* gy, long k, const Images& images,
                                long first, long count, Scratch in, Scratch grad, float* s);

// u [36][in][out] = G g G^T of each filter of g [3][3][in][out].
using TransformWeights = void (*)(const float* g, long in, long out, float* u);
// g [3][3][in][out] = G^T s G of each of s [36][in][out]: the weight gradient.
using TransformBack = void (*)(const float* s, long in, long out, float* g);

struct Kernel {
  Forward forward;
  WeightGradient weight_gradient;
  TransformWeights transform_weights;
  TransformBack transform_back;
};
extern const Kernel kAvx512; // x86-64-v4
extern const Kernel kAvx2;   // x86-64-v3

} // namespace flotilla::models::winograd_kernels
