// The only translation unit that includes Gloo: c10d's ProcessGroupGloo over Gloo's TCP pairs.
#include <gloo/common/error.h>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include "collective/backends.h"

namespace flotilla::collective::detail {

c10::intrusive_ptr<c10d::Backend> make_gloo_backend(const c10::intrusive_ptr<c10d::Store>& store,
                                                    int rank, int size,
                                                    const std::string& local_host,
                                                    std::chrono::milliseconds timeout) {
  auto options = c10d::ProcessGroupGloo::Options::create(timeout);
  options->devices.push_back(local_host.empty()
                                 ? c10d::ProcessGroupGloo::createDefaultDevice()
                                 : c10d::ProcessGroupGloo::createDeviceForHostname(local_host));
  return c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, size, options);
}

bool is_gloo_transport_error(const std::exception& e) {
  return dynamic_cast<const ::gloo::IoException*>(&e) != nullptr;
}

} // namespace flotilla::collective::detail
