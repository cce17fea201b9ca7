// How a backend's failure is classified: by its type where the type says it, by its words
// otherwise; and, with real Gloo process groups, that the common failures (a timeout, a closed
// peer) are the types the typed path catches.
#include "collective/backend_failure.h"

#include <gloo/common/error.h>
#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/exception.h>

#include <cstdlib>
#include <stdexcept>
#include <thread>

#include "collective/backends.h"
#include "flotilla/error.h"

namespace flotilla::collective::detail {
namespace {

template <class E> E c10_error(const std::string& message) {
  return E(c10::SourceLocation{__func__, __FILE__, __LINE__}, message);
}

TEST(BackendFailure, TheTypeDecidesWhereTheWordsAloneWouldNot) {
  // c10d's timeout type is a timeout whatever it says.
  EXPECT_EQ(classify_failure(c10_error<c10d::TimeoutError>("the store gave up")),
            FailureKind::kTimeout);
  EXPECT_EQ(classify_failure(TimeoutError("the rendezvous gave up")), FailureKind::kTimeout);
  // A network error that names no lost connection is still one: the words alone say kOther.
  EXPECT_EQ(classify_failure(c10_error<c10::DistNetworkError>("No route to host")),
            FailureKind::kConnectionLoss);
  EXPECT_EQ(classify_failure(gloo::IoException("Read error [10.0.0.2]:4000: No route to host")),
            FailureKind::kConnectionLoss);
  EXPECT_EQ(classify_failure(std::runtime_error("Read error [10.0.0.2]:4000: No route to host")),
            FailureKind::kOther);
  // The network's types cover timeouts too; their words tell them apart.
  EXPECT_EQ(classify_failure(c10_error<c10::DistNetworkError>("Socket Timeout")),
            FailureKind::kTimeout);
  EXPECT_EQ(classify_failure(
                gloo::IoException("Timed out waiting 1000ms for recv operation to complete")),
            FailureKind::kTimeout);
}

TEST(BackendFailure, UntypedFailuresAreJudgedByTheirWords) {
  EXPECT_EQ(classify_failure(std::runtime_error("Connection closed by peer [127.0.0.1]:80")),
            FailureKind::kConnectionLoss);
  EXPECT_EQ(classify_failure(c10_error<c10::Error>("Operation timed out!")), FailureKind::kTimeout);
  EXPECT_EQ(classify_failure(c10_error<c10::DistStoreError>("Wait timeout")),
            FailureKind::kTimeout);
  EXPECT_EQ(classify_failure(
                c10_error<c10::DistBackendError>("Watchdog caught collective operation timeout")),
            FailureKind::kTimeout);
  EXPECT_EQ(classify_failure(c10_error<c10::DistBackendError>("NCCL error: invalid argument")),
            FailureKind::kOther);
}

TEST(BackendFailure, TheMessageLosesGloosSourcePrefixAndC10sBacktrace) {
  EXPECT_EQ(backend_message(std::runtime_error(
                "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:547] Connection closed by "
                "peer [127.0.0.1]:4295\n")),
            "Connection closed by peer [127.0.0.1]:4295");
  // A bracket that is not a source location stays.
  EXPECT_EQ(backend_message(std::runtime_error("[rank 1] lost")), "[rank 1] lost");
  EXPECT_EQ(backend_message(c10_error<c10::Error>("Operation timed out!")), "Operation timed out!");
}

// Two ranks of Gloo over an in-memory store, as threads; a backend's constructor waits for the
// other's.
std::pair<c10::intrusive_ptr<c10d::Backend>, c10::intrusive_ptr<c10d::Backend>>
gloo_pair(std::chrono::milliseconds timeout) {
  ::setenv("TORCH_FR_BUFFER_SIZE", "0", /*overwrite=*/0); // as Communicator does
  auto store = c10::make_intrusive<c10d::HashStore>();
  c10::intrusive_ptr<c10d::Backend> one;
  std::thread other([&] { one = make_gloo_backend(store, 1, 2, "127.0.0.1", timeout); });
  auto zero = make_gloo_backend(store, 0, 2, "127.0.0.1", timeout);
  other.join();
  return {zero, one};
}

// The failure of an all-reduce that rank 0 runs alone.
std::exception_ptr lone_all_reduce(c10d::Backend& backend) {
  std::vector<at::Tensor> tensors{at::ones({8})};
  try {
    backend.allreduce(tensors)->wait();
  } catch (...) {
    return std::current_exception();
  }
  return nullptr;
}

TEST(BackendFailure, GloosTimeoutAndClosedPeerAreCaughtByType) {
  {
    auto [zero, one] = gloo_pair(std::chrono::milliseconds(500));
    const auto error = lone_all_reduce(*zero); // rank 1 never joins it
    ASSERT_TRUE(error) << "completed without rank 1";
    try {
      std::rethrow_exception(error);
    } catch (const std::exception& e) {
      EXPECT_TRUE(is_gloo_transport_error(e)) << backend_message(e);
      EXPECT_EQ(classify_failure(e), FailureKind::kTimeout) << backend_message(e);
    }
  }
  {
    auto [zero, one] = gloo_pair(std::chrono::seconds(30));
    one.reset(); // rank 1 leaves: its connections close
    const auto error = lone_all_reduce(*zero);
    ASSERT_TRUE(error) << "completed without rank 1";
    try {
      std::rethrow_exception(error);
    } catch (const std::exception& e) {
      EXPECT_TRUE(is_gloo_transport_error(e)) << backend_message(e);
      EXPECT_EQ(classify_failure(e), FailureKind::kConnectionLoss) << backend_message(e);
    }
  }
}

} // namespace
} // namespace flotilla::collective::detail
