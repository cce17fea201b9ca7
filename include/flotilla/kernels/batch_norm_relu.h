// relu(batch_norm(x)) and relu(batch_norm(x) + residual) as one operation: what a ResNet's
// "BatchNorm, ReLU" and its block's "BatchNorm, add the shortcut, ReLU" compute; and with ReLU6
// (MobileNet's "BatchNorm, ReLU6") in place of the ReLU. On a CPU with
// AVX-512 or AVX2, for channels-last float32 or bfloat16 input (channels a multiple of 16), in
// training, forward makes two passes (the batch statistics; then normalize, add, ReLU) and
// backward two (the sums; then the input's and the residual's gradients). Counted in
// activation-sized reads and writes, a step costs 10 instead of the separate operations' 13,
// and 12 instead of 16 with the residual: BatchNorm needs two passes each way either way, so
// this saves a quarter of the element-wise traffic, not more (bench/batch_norm_relu.cpp).
// The running statistics are updated as ATen's batch_norm updates them (momentum as the factor,
// unbiased variance). Sums run in double (over runs of 16 rows summed in float). Values are those
// of the separate operations within float rounding (batch_norm_relu_test.cpp). In evaluation
// without gradients it normalizes with the running statistics in one pass. Anything else
// (another device or layout, other types, no affine weights, evaluation with gradients) runs
// ATen's batch_norm, then the add and relu; so does every shape where ATen's measured faster
// (choice.h).
#pragma once

#include <torch/nn/modules/batchnorm.h>

#include <optional>
#include <string>

namespace flotilla::kernels {

// relu(at::batch_norm(x, weight, bias, running_mean, running_var, training, momentum, eps)
// [+ residual]). `residual`, where given, has x's shape and type. `ceiling`: ReLU6's (6), or
// any hardtanh(0, ceiling), in place of the ReLU.
torch::Tensor batch_norm_relu(const torch::Tensor& x, const std::optional<torch::Tensor>& weight,
                              const std::optional<torch::Tensor>& bias,
                              const std::optional<torch::Tensor>& running_mean,
                              const std::optional<torch::Tensor>& running_var, bool training,
                              double momentum, double eps,
                              const std::optional<torch::Tensor>& residual = std::nullopt,
                              const std::optional<double>& ceiling = std::nullopt);

// relu(bn.forward(x) [+ residual]): `bn`'s weights, options and running statistics, and its
// forward's bookkeeping (num_batches_tracked, a cumulative average where momentum is unset).
torch::Tensor batch_norm_relu(torch::nn::BatchNorm2dImpl& bn, const torch::Tensor& x,
                              const torch::Tensor& residual = {},
                              const std::optional<double>& ceiling = std::nullopt);

// Whether flotilla's kernel can run it (it may still lose the measurement).
bool batch_norm_relu_applies(const torch::Tensor& x, const torch::Tensor& weight,
                             const torch::Tensor& bias, const torch::Tensor& residual = {});

// The instruction set batch_norm_relu's kernel runs: "avx512" or "avx2" (the best this CPU has),
// or "none" (ATen's ops always). The environment variable FLOTILLA_BATCH_NORM_RELU_KERNEL
// (avx512, avx2, none) chooses another at the first use, where this CPU runs it.
const char* batch_norm_relu_kernel();
// Runs `name`'s kernel from now on (for tests and benchmarks); false, and nothing changes,
// where this CPU lacks it.
bool use_batch_norm_relu_kernel(const std::string& name);

} // namespace flotilla::kernels
