// ConvMaxPool2ReLU's kernels for AVX2 and FMA (x86-64-v3); see conv_pool_relu_kernel.inc.
#define KERNEL_NAMESPACE avx2
#define KERNEL kAvx2
#define KERNEL_LANES 8
#include "kernels/conv_pool_relu_kernel.inc"
