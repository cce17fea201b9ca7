// kernels::hash_dropout's kernel for AVX-512 (x86-64-v4); see dropout_kernel.inc.
#define KERNEL_NAMESPACE avx512
#define KERNEL kAvx512
#define KERNEL_LANES 16
#include "kernels/dropout_kernel.inc"
