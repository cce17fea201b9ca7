// Collectives on CUDA tensors (label gpu: skipped where no CUDA device is visible). AUTO sends
// CUDA tensors through NCCL; RING sends them through Gloo, which stages them through the host.
#include <gtest/gtest.h>
#include <torch/cuda.h>

#include "flotilla/collective/communicator.h"
#include "flotilla/error.h"
#include "support/ranks.h"

namespace flotilla::collective {
namespace {

using flotilla::testing::run_ranks;

// Why these tests cannot run here, or "" when they can.
std::string missing_cuda() {
  if (!torch::cuda::is_available()) return "no CUDA device visible";
  if (!nccl_available()) return "this build has no NCCL backend";
  return "";
}

TEST(CudaCollectives, AutoUsesNcclForCudaTensorsAndGlooForCpuTensors) {
  if (!missing_cuda().empty()) GTEST_SKIP() << missing_cuda();
  auto comm = Communicator::local_group(1).front();
  auto t = torch::arange(1000, torch::TensorOptions().dtype(torch::kFloat32).device(torch::kCUDA));
  EXPECT_EQ(comm.transport(t), "nccl");
  EXPECT_EQ(comm.transport(torch::ones({1})), "gloo");
  comm.all_reduce(t, ReduceOp::kMean).wait();
  EXPECT_TRUE(torch::equal(t.cpu(), torch::arange(1000, torch::kFloat32)));
  comm.broadcast(t, 0).wait();
  comm.barrier().wait();
}

TEST(CudaCollectives, RingReducesCudaTensorsAcrossRanks) {
  if (!missing_cuda().empty()) GTEST_SKIP() << missing_cuda();
  CommunicationOptions options;
  options.implementation = Implementation::kRing;
  run_ranks(
      2,
      [](int rank, Communicator& comm) {
        auto t = torch::full({(1 << 20) + 3}, static_cast<float>(rank + 1),
                             torch::TensorOptions().device(torch::kCUDA));
        EXPECT_EQ(comm.transport(t), "gloo");
        comm.all_reduce(t, ReduceOp::kSum).wait();
        EXPECT_TRUE(torch::equal(t.cpu(), torch::full({(1 << 20) + 3}, 3.0f)));
        EXPECT_TRUE(t.is_cuda());
      },
      options);
}

} // namespace
} // namespace flotilla::collective
