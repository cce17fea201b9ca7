// Replica devices: what "auto", "cpu", "cuda:N" and TF's "/gpu:N" mean, and the errors for a list
// that cannot work. The answers depend on the GPUs visible, so each expectation says which.
#include <gtest/gtest.h>
#include <torch/cuda.h>

#include <string>
#include <vector>

#include "flotilla/error.h"
#include "flotilla/strategy/strategy.h"

namespace flotilla::strategy {
namespace {

int gpus() {
  return torch::cuda::is_available() ? static_cast<int>(torch::cuda::device_count()) : 0;
}

// The ConfigError's message, or "" when none was thrown.
template <class F> std::string config_error(F&& f) {
  try {
    f();
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "";
}

TEST(Devices, AutoIsEveryVisibleGpuElseOneCpuReplica) {
  const auto devices = parse_devices("auto");
  if (gpus() == 0) {
    ASSERT_EQ(devices.size(), 1u);
    EXPECT_TRUE(devices[0].is_cpu());
    EXPECT_EQ(default_devices(3), std::vector<torch::Device>(3, torch::Device(torch::kCPU)));
  } else {
    ASSERT_EQ(static_cast<int>(devices.size()), gpus());
    for (int i = 0; i < gpus(); ++i) EXPECT_EQ(devices[i], torch::Device(torch::kCUDA, i));
    EXPECT_EQ(default_devices(1), std::vector<torch::Device>{torch::Device(torch::kCUDA, 0)});
  }
  EXPECT_EQ(parse_devices("cpu,CPU"), std::vector<torch::Device>(2, torch::Device(torch::kCPU)));
  EXPECT_NE(config_error([] { default_devices(-1); }).find("saw -1"), std::string::npos);
}

TEST(Devices, ListsThatCannotWorkAreRefusedWithWhatIsVisible) {
  // A GPU beyond those visible (TF's spelling too), named with what there is.
  const std::string beyond = "/GPU:" + std::to_string(gpus());
  const std::string error = config_error([&] { parse_devices(beyond); });
  EXPECT_NE(error.find("cuda:" + std::to_string(gpus())), std::string::npos) << error;
  EXPECT_NE(error.find(gpus() == 0 ? "no CUDA device is visible" : "CUDA_VISIBLE_DEVICES"),
            std::string::npos)
      << error;
  if (gpus() == 0) {
    EXPECT_NE(config_error([] {
                parse_devices("cuda");
              }).find("use the CPU (strategy::parse_devices(\"cpu\"))"),
              std::string::npos);
    EXPECT_EQ(config_error([] { default_devices(0); }), ""); // one CPU replica
  }
  EXPECT_NE(config_error([] { parse_devices("tpu:0"); }).find("\"tpu:0\""), std::string::npos);
  EXPECT_NE(config_error([] { parse_devices("cpu,,cpu"); }).find("is not a device"),
            std::string::npos);
  // CPU and CUDA replicas of one model cannot be reduced as one.
  EXPECT_NE(config_error([] {
              check_devices({torch::Device("cuda:0"), torch::Device("cpu")});
            }).find("mix the CPU and CUDA"),
            std::string::npos);
  EXPECT_NE(config_error([] { check_devices({}); }).find("empty"), std::string::npos);
}

TEST(Devices, WorkersOnOneHostSplitItsGpus) {
  for (int workers : {1, 2, 3}) {
    for (int rank = 0; rank < workers; ++rank) {
      const auto mine = local_share_of_devices(rank, workers);
      if (gpus() == 0) {
        EXPECT_EQ(mine, std::vector<torch::Device>{torch::Device(torch::kCPU)});
      } else if (gpus() >= workers) {
        ASSERT_EQ(static_cast<int>(mine.size()), gpus() / workers);
        EXPECT_EQ(mine.front().index(), rank * (gpus() / workers)); // disjoint shares
      } else {
        EXPECT_EQ(mine, std::vector<torch::Device>{torch::Device(torch::kCUDA, rank % gpus())});
      }
    }
  }
  EXPECT_NE(config_error([] { local_share_of_devices(2, 2); }).find("local rank 2 of 2"),
            std::string::npos);
  // TF's long spelling, with spaces after the commas.
  if (gpus() == 0) {
    EXPECT_NE(config_error([] { parse_devices("cpu, /device:GPU:0"); }).find("cuda:0"),
              std::string::npos);
  }
}

TEST(Devices, MirroredStrategyRunsAReplicaPerListedDevice) {
  MirroredStrategy strategy(parse_devices("cpu,cpu,cpu"));
  EXPECT_EQ(strategy.replicas_per_worker(), 3);
  EXPECT_EQ(strategy.num_replicas_in_sync(), 3);
  EXPECT_TRUE(strategy.devices().back().is_cpu());
  // The model built in scope() lives on the first device.
  auto net = strategy.scope([] { return torch::nn::Linear(4, 2); });
  EXPECT_EQ(net->weight.device(), strategy.devices().front());
}

} // namespace
} // namespace flotilla::strategy
