// The only translation unit that includes NCCL: c10d's ProcessGroupNCCL, built when LibTorch
// has CUDA. It reduces CUDA tensors on the device current when the group is made.
#include <torch/csrc/cuda/nccl.h>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>

#include <set>

#include "collective/backends.h"

namespace flotilla::collective::detail {

bool nccl_built() {
  return true;
}

c10::intrusive_ptr<c10d::Backend> make_nccl_backend(const c10::intrusive_ptr<c10d::Store>& store,
                                                    int rank, int size,
                                                    std::chrono::milliseconds timeout) {
  auto options = c10d::ProcessGroupNCCL::Options::create();
  options->timeout = timeout;
  return c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, size, options);
}

bool nccl_local_usable(const std::vector<at::Tensor>& tensors) {
  if (tensors.size() < 2) return false;
  std::set<int> devices;
  for (const auto& t : tensors) {
    // NCCL reads flat buffers; the gradient engine's buckets are.
    if (!t.is_cuda() || !t.is_contiguous() || t.scalar_type() != tensors.front().scalar_type() ||
        t.numel() != tensors.front().numel() || !devices.insert(t.get_device()).second) {
      return false;
    }
  }
  return true;
}

bool nccl_local_reduce(const std::vector<at::Tensor>& tensors) {
  if (!nccl_local_usable(tensors)) return false;
  std::vector<at::Tensor> inputs = tensors;
  // In place into tensors[0], on every device's current stream (the defaults: empty lists).
  torch::cuda::nccl::reduce(inputs, /*root=*/0);
  return true;
}

bool nccl_local_broadcast(const std::vector<at::Tensor>& tensors) {
  if (!nccl_local_usable(tensors)) return false;
  torch::cuda::nccl::broadcast(tensors);
  return true;
}

} // namespace flotilla::collective::detail
