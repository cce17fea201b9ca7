// Private: what a backend's exception says happened, so a failed collective is raised as
// TimeoutError or CommError with advice that fits. The exception's type decides where it can:
// c10d's TimeoutError is a timeout; c10d's network errors (DistNetworkError) and Gloo's transport
// errors (gloo::IoException, which ProcessGroupGloo rethrows unwrapped for a timeout and a lost
// peer alike) are the network's, and only their words tell a timeout from a lost connection.
// Anything else (NCCL's DistBackendError, a store's DistStoreError, the plain c10::Error of
// c10d::Work::wait's own limit, an untyped std::exception) is judged by its words alone.
#pragma once

#include <exception>
#include <string>

namespace flotilla::collective::detail {

enum class FailureKind {
  kTimeout,        // the backend gave up waiting for a peer
  kConnectionLoss, // a peer closed its connection, or the network between them failed
  kOther,
};

FailureKind classify_failure(const std::exception& e);

// The backend's own words, without c10's backtrace or Gloo's source-file prefix.
std::string backend_message(const std::exception& e);

} // namespace flotilla::collective::detail
