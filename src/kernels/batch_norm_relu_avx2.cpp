// batch_norm_relu's kernels for AVX2 (x86-64-v3); see batch_norm_relu_kernel.inc.
#define KERNEL_NAMESPACE avx2
#define KERNEL kAvx2
#define KERNEL_LANES 8
#include "kernels/batch_norm_relu_kernel.inc"
