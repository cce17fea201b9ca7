// The only translation unit that includes NCCL: c10d's ProcessGroupNCCL, built when LibTorch
// has CUDA. It reduces CUDA tensors on the device current when the group is made.
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>

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

} // namespace flotilla::collective::detail
