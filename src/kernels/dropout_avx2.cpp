// kernels::hash_dropout's kernel for AVX2 (x86-64-v3); see dropout_kernel.inc.
#define KERNEL_NAMESPACE avx2
#define KERNEL kAvx2
#define KERNEL_LANES 8
#include "kernels/dropout_kernel.inc"
