// prefetch_to_device on CUDA (label gpu: skipped where no CUDA device is visible). Elements
// arrive on the device complete and equal to their sources, pinned or not, and stay intact
// while the consumer runs ahead of the GPU and drops batches whose kernels are still queued,
// as an asynchronous training loop does.
#include <gtest/gtest.h>
#include <torch/cuda.h>

#include <cmath>

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "flotilla/data/dataset.h"
#include "flotilla/error.h"

namespace flotilla::data {
namespace {

const torch::Device kCuda0(torch::kCUDA, 0);

TEST(PrefetchToDeviceCuda, ElementsArriveOnTheDeviceWithTheirValues) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device visible";
  const auto x = torch::arange(1000, torch::kFloat32).reshape({100, 10});
  const auto y = torch::arange(100, torch::kInt64) * 7;
  const auto ds = Dataset::from_tensor_slices({x, y}).batch(8).prefetch_to_device(kCuda0, 2);
  // The same elements wherever they are prefetched to: a pass resumed on another device (or
  // with another buffer) continues the same sequence.
  EXPECT_EQ(ds.fingerprint(), Dataset::from_tensor_slices({x, y})
                                  .batch(8)
                                  .prefetch_to_device(torch::Device(torch::kCPU), 1)
                                  .fingerprint());
  std::int64_t row = 0;
  for (const Element& e : ds.make_iterator()) {
    ASSERT_EQ(e.size(), 2u);
    EXPECT_EQ(e[0].device(), kCuda0);
    EXPECT_EQ(e[1].device(), kCuda0);
    const std::int64_t n = e[0].size(0);
    EXPECT_TRUE(torch::equal(e[0].cpu(), x.narrow(0, row, n))) << "rows from " << row;
    EXPECT_TRUE(torch::equal(e[1].cpu(), y.narrow(0, row, n))) << "rows from " << row;
    row += n;
  }
  EXPECT_EQ(row, 100);
  // A bare "cuda" is the current device.
  const auto bare = Dataset::range(3).prefetch_to_device(torch::Device(torch::kCUDA));
  std::int64_t n = 0;
  for (const Element& e : bare.make_iterator()) {
    EXPECT_EQ(e.at(0).device(), kCuda0);
    EXPECT_EQ(e.at(0).item<std::int64_t>(), n++);
  }
  EXPECT_EQ(n, 3);
}

TEST(PrefetchToDeviceCuda, PinnedPageableStridedAndDeviceSourcesAllArrive) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device visible";
  torch::manual_seed(11);
  const auto base = torch::rand({64, 32});
  const auto pageable = base.clone();
  const auto pinned = base.pin_memory();
  const auto strided = base.t(); // not contiguous
  const auto on_device = base.to(kCuda0);
  ASSERT_FALSE(pageable.is_pinned());
  ASSERT_TRUE(pinned.is_pinned());
  const auto ds = Dataset::from_tensors({pageable, pinned, strided, on_device})
                      .repeat(6)
                      .prefetch_to_device(kCuda0, 2);
  // Read on a stream other than the copy's and the default one, without synchronizing: the
  // stage has waited for the copy already.
  const c10::cuda::CUDAStreamGuard side(c10::cuda::getStreamFromPool(false, 0));
  int count = 0;
  for (const Element& e : ds.make_iterator()) {
    ASSERT_EQ(e.size(), 4u);
    for (const auto& t : e) EXPECT_EQ(t.device(), kCuda0);
    EXPECT_TRUE(torch::equal(e[0].cpu(), base));
    EXPECT_TRUE(torch::equal(e[1].cpu(), base));
    EXPECT_TRUE(torch::equal(e[2].cpu(), base.t()));
    EXPECT_TRUE(torch::equal((e[0] - e[3]).abs().sum().cpu(), torch::zeros({})));
    // Already on the device: the very same memory, not a copy.
    EXPECT_EQ(e[3].data_ptr(), on_device.data_ptr());
    ++count;
  }
  EXPECT_EQ(count, 6);
}

TEST(PrefetchToDeviceCuda, A200BatchPassHasTheSameSumsAsTheCpuPass) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device visible";
  constexpr std::int64_t kBatches = 200, kBatch = 64;
  torch::manual_seed(5);
  const auto ints = torch::randint(0, 1 << 20, {kBatches * kBatch, 128}, torch::kInt64);
  const auto floats = torch::rand({kBatches * kBatch, 96}, torch::kFloat64);
  auto pipeline = [&](torch::Device device) {
    return Dataset::from_tensor_slices({ints, floats})
        .shuffle(1024, 9, /*reshuffle_each_iteration=*/false)
        .batch(kBatch)
        .prefetch_to_device(device, 3);
  };

  std::vector<torch::Tensor> cpu_sums;
  for (const Element& e : pipeline(torch::kCPU).make_iterator()) {
    cpu_sums.push_back(torch::stack({e[0].sum().to(torch::kFloat64), e[1].sum()}));
  }
  ASSERT_EQ(static_cast<std::int64_t>(cpu_sums.size()), kBatches);

  // The step: enough work queued on the default stream for the consumer to run far ahead of
  // the GPU and drop each batch while the kernels that read it are still waiting to run.
  const auto big = torch::rand({2048, 2048}, torch::TensorOptions().device(kCuda0));
  std::vector<torch::Tensor> gpu_sums; // stay on the device: nothing synchronizes in the loop
  torch::Tensor sink = torch::zeros({}, torch::TensorOptions().device(kCuda0));
  {
    auto it = pipeline(kCuda0).make_iterator();
    while (auto e = it.next()) {
      ASSERT_EQ((*e)[0].device(), kCuda0);
      sink = sink + torch::matmul(big, big).sum();
      gpu_sums.push_back(torch::stack({(*e)[0].sum().to(torch::kFloat64), (*e)[1].sum()}));
    }
  }
  ASSERT_EQ(static_cast<std::int64_t>(gpu_sums.size()), kBatches);
  const auto cpu = torch::stack(cpu_sums);
  const auto gpu = torch::stack(gpu_sums).cpu();
  EXPECT_TRUE(torch::equal(gpu.select(1, 0), cpu.select(1, 0))); // integer sums: exact
  EXPECT_TRUE(torch::allclose(gpu.select(1, 1), cpu.select(1, 1), 1e-12, 0));
  EXPECT_TRUE(std::isfinite(sink.item<double>()));
}

TEST(PrefetchToDeviceCuda, RefusesTheFirstIndexPastTheVisibleDevices) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device visible";
  const auto count = static_cast<int>(torch::cuda::device_count());
  const torch::Device past(torch::kCUDA, static_cast<c10::DeviceIndex>(count));
  try {
    Dataset::range(3).prefetch_to_device(past);
    FAIL() << past << " was accepted";
  } catch (const ConfigError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find(past.str()), std::string::npos) << what;
    EXPECT_NE(what.find("CUDA_VISIBLE_DEVICES"), std::string::npos) << what;
  }
}

} // namespace
} // namespace flotilla::data
