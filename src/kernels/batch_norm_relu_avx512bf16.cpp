// batch_norm_relu's kernels for AVX-512 with AVX512_BF16 (x86-64-v4 and its bfloat16
// rounding instruction); see batch_norm_relu_kernel.inc.
#define KERNEL_NAMESPACE avx512bf16
#define KERNEL kAvx512Bf16
#define KERNEL_LANES 16
#define KERNEL_BF16_INSTRUCTIONS
#include "kernels/batch_norm_relu_kernel.inc"
