#include "collective/backend_failure.h"

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/exception.h>

#include "collective/backends.h"
#include "flotilla/error.h"

namespace flotilla::collective::detail {

namespace {

bool mentions_any(const std::string& message, std::initializer_list<const char*> needles) {
  for (const char* needle : needles) {
    if (message.find(needle) != std::string::npos) return true;
  }
  return false;
}

// Gloo's "Timed out waiting 1000ms for recv operation", "Read timeout", "Connect timeout";
// c10d's "Socket Timeout"; a store's "Wait timeout"; c10d::Work's "Operation timed out!".
bool mentions_timeout(const std::string& message) {
  return mentions_any(message, {"Timed out", "timed out", "Timeout", "timeout"});
}

// Gloo's "Connection closed by peer", "Connection reset by peer", a send's "Broken pipe".
bool mentions_connection_loss(const std::string& message) {
  return mentions_any(message, {"closed", "reset", "Connection", "peer", "Broken pipe"});
}

} // namespace

FailureKind classify_failure(const std::exception& e) {
  if (dynamic_cast<const c10d::TimeoutError*>(&e) || dynamic_cast<const TimeoutError*>(&e)) {
    return FailureKind::kTimeout;
  }
  const std::string message = backend_message(e);
  if (dynamic_cast<const c10::DistNetworkError*>(&e) || is_gloo_transport_error(e)) {
    return mentions_timeout(message) ? FailureKind::kTimeout : FailureKind::kConnectionLoss;
  }
  if (mentions_timeout(message)) return FailureKind::kTimeout;
  if (mentions_connection_loss(message)) return FailureKind::kConnectionLoss;
  return FailureKind::kOther;
}

std::string backend_message(const std::exception& e) {
  std::string what;
  if (const auto* c10_error = dynamic_cast<const c10::Error*>(&e)) {
    what = c10_error->what_without_backtrace();
  } else {
    what = e.what();
  }
  if (what.rfind("[", 0) == 0) {
    const auto close = what.find("] ");
    if (close != std::string::npos && what.find(".cc:") < close) what = what.substr(close + 2);
  }
  while (!what.empty() && (what.back() == '\n' || what.back() == ' ')) what.pop_back();
  return what;
}

} // namespace flotilla::collective::detail
