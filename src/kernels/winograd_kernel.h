// The kernels of the Winograd 3x3 convolution (winograd.h): F(4x4, 3x3), stride 1, padding 1,
// over channels-last float32 images whose channel counts are multiples of 16. Each 4x4 block of
// outputs (a tile) is computed from the 6x6 block of inputs around it: the input tile is
// transformed (B^T d B), each of the 36 positions multiplies its [tiles x C] by the transformed
// weights' [C x K], and the products are transformed back (A^T m A). That is 36 products per 16
// outputs a channel pair where the direct convolution takes 144. Where a side is not a multiple
// of 4, the last row or column of tiles is 3 or 2 outputs deep (F(3, 3): 5 positions; F(2, 3):
// 4) instead of a 4-deep tile with outputs thrown away: at 14x14, 22 positions a line against 24;
// at 7x7, 11 against 12.
// This header includes no other, for the reason conv_pool_relu_kernel.h gives:
// winograd_kernel.inc is compiled once per instruction set into its own namespace.
#pragma once

namespace flotilla::kernels::winograd_kernels {

constexpr int kPositions = 36; // of a 6x6 transformed tile, the most a tile has
// The transformed weights are kept in panels of 16 outputs, [out / 16][positions][in][16], each
// panel contiguous: a product step reads its weights in order (rows `out` floats apart would
// fall on few cache sets), and a panel can be transformed just before its products.
constexpr int kPanel = 16;

// Images [n][h][w][channels]. The images (x, y, gy below) are floats, or bfloat16 bits (`bf16`:
// read widened to float, written rounded to nearest even); weights and the arithmetic are float
// either way.
struct Images {
  long n, h, w;
  bool bf16;
};

// The tiles of one size: `rows` x `cols` outputs each (4, 3 or 2; a tile's outputs past the
// image's edge are not written), tiles_h x tiles_w of them an image, 4 outputs apart, the first
// at (row0, col0). Tiles are numbered image by image, row by row. positions() of each tile's
// transform: (rows + 2) x (cols + 2).
struct Part {
  int rows, cols;
  long row0, col0;
  long tiles_h, tiles_w;
  int positions() const { return (rows + 2) * (cols + 2); }
};

// Scratch for `count` tiles: transformed tiles [positions][count][channels], each position
// `stride` floats from the last (a stride a little over count x channels keeps the streams off
// the same cache sets).
struct Scratch {
  float* data;
  long stride;
};

// The weights of a forward: u, all panels transformed for the part (transform_weights); or,
// where u is null, the filters g, each panel transformed into `panel` ([positions][c][kPanel])
// before its products, so the transformed weights never leave the core's cache (they are 4x g's
// size). Filters are laid out by panel too: g [k / kPanel][3][3][c][kPanel].
struct Weights {
  const float* u;
  const float* g;
  float* panel;
};

// y (channels k) of the part's tiles [first, first + count) from x (channels c) and the
// weights. `in` and `out` hold count tiles of c and of k channels.
using Forward = void (*)(const void* x, long c, const Images& images, const Part& part,
                         const Weights& w, long k, long first, long count, Scratch in, Scratch out,
                         void* y);
// Adds (or with `accumulate` false, writes), for the part's tiles [first, first + count), the
// products of gy's transformed gradient tiles (k channels) and x's transformed input tiles (c
// channels) into s [positions][k][c]: the part's weight gradient before its transform back.
using WeightGradient = void (*)(const void* x, long c, const void* gy, long k, const Images& images,
                                const Part& part, long first, long count, Scratch in, Scratch grad,
                                bool accumulate, float* s);

// u [out / kPanel][positions][in][kPanel]: each filter of g [out / kPanel][3][3][in][kPanel]
// transformed for the part's tiles (G g G^T, G of the rows' size on the left, the columns' on
// the right).
using TransformWeights = void (*)(const float* g, long in, long out, const Part& part, float* u);
// g [out][3][3][in] (a convolution's channels-last weights) = the transform back of each of s
// [positions][out][in] (G^T s G): the part's tiles' share of the weight gradient.
using TransformBack = void (*)(const float* s, long out, long in, const Part& part, float* g);

struct Kernel {
  Forward forward;
  WeightGradient weight_gradient;
  TransformWeights transform_weights;
  TransformBack transform_back;
};
extern const Kernel kAvx512; // x86-64-v4
extern const Kernel kAvx2;   // x86-64-v3

} // namespace flotilla::kernels::winograd_kernels
