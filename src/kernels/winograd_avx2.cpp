// The Winograd convolution's kernels for AVX2 (x86-64-v3); see winograd_kernel.inc.
#define KERNEL_NAMESPACE avx2
#define KERNEL kAvx2
#define KERNEL_LANES 8
#include "kernels/winograd_kernel.inc"
