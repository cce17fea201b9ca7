// Built where LibTorch has no CUDA: NCCL is reported absent and asking for it is a clear error.
#include "collective/backends.h"
#include "flotilla/error.h"

namespace flotilla::collective::detail {

bool nccl_built() {
  return false;
}

c10::intrusive_ptr<c10d::Backend> make_nccl_backend(const c10::intrusive_ptr<c10d::Store>&, int,
                                                    int, std::chrono::milliseconds) {
  throw ConfigError(
      "the NCCL backend is not built: this LibTorch has no CUDA; use implementation RING (or "
      "AUTO) for CPU training, or build against a CUDA LibTorch");
}

bool nccl_local_usable(const std::vector<at::Tensor>&) {
  return false;
}
bool nccl_local_reduce(const std::vector<at::Tensor>&) {
  return false;
}
bool nccl_local_broadcast(const std::vector<at::Tensor>&) {
  return false;
}

} // namespace flotilla::collective::detail
