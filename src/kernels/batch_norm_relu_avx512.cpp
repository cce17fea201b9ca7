// batch_norm_relu's kernels for AVX-512 (x86-64-v4); see batch_norm_relu_kernel.inc.
#define KERNEL_NAMESPACE avx512
#define KERNEL kAvx512
#define KERNEL_LANES 16
#include "kernels/batch_norm_relu_kernel.inc"
