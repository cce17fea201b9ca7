#include "train/step_graph.h"

#include "flotilla/error.h"

#ifdef FLOTILLA_WITH_CUDA
#include <ATen/cuda/CUDAEvent.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include <optional>

namespace flotilla::train::detail {

#ifdef FLOTILLA_WITH_CUDA

bool cuda_graphs_built() {
  return true;
}

struct SideStream::Impl {
  explicit Impl(const torch::Device& device)
      : stream(c10::cuda::getStreamFromPool(/*isHighPriority=*/false, device.index())) {}
  c10::cuda::CUDAStream stream;
};

struct SideStream::Use::Impl {
  explicit Impl(const c10::cuda::CUDAStream& stream) : stream(stream), guard(stream) {
    // After everything queued so far on the default stream (initialisation, the mirror
    // broadcast, copies).
    at::cuda::CUDAEvent ready;
    ready.record(c10::cuda::getDefaultCUDAStream(stream.device_index()));
    ready.block(stream);
  }
  ~Impl() {
    // And the default stream after everything the side stream did. (A failing device has
    // already reported its error; a destructor must not throw another.)
    try {
      at::cuda::CUDAEvent done;
      done.record(stream);
      done.block(c10::cuda::getDefaultCUDAStream(stream.device_index()));
    } catch (...) {
    }
  }
  c10::cuda::CUDAStream stream;
  c10::cuda::CUDAStreamGuard guard;
};

SideStream::SideStream(const torch::Device& device) : impl_(std::make_unique<Impl>(device)) {}
SideStream::Use::Use(SideStream& side) : impl_(std::make_unique<Impl>(side.impl_->stream)) {}
SideStream::Use::~Use() = default;

void use_on_current_stream(const torch::Tensor& t) {
  if (t.defined() && t.is_cuda()) t.record_stream(c10::cuda::getCurrentCUDAStream(t.get_device()));
}

struct StepGraph::Impl {
  at::cuda::CUDAGraph graph;
  bool captured = false;
};

void StepGraph::capture(const std::function<void()>& body) {
  // Thread-local mode: the input pipeline's threads keep copying (and synchronising their own
  // stream) while this thread captures; global mode would refuse their calls.
  // The pool is named here, not read back with graph.pool(): LibTorch answers that only after a
  // successful capture, and a failed one must still hand its pool back.
  const auto pool = at::cuda::graph_pool_handle();
  const auto device = c10::cuda::current_device();
  impl_->graph.capture_begin(pool, cudaStreamCaptureModeThreadLocal);
  auto end = [&] {
    try {
      impl_->graph.capture_end();
      return;
    } catch (...) {
      // capture_end gives up before telling the allocator the capture is over; left so, the
      // allocator would stop recycling blocks used on other streams for the rest of the run.
      c10::cuda::CUDACachingAllocator::endAllocateToPool(device, pool);
      c10::cuda::CUDACachingAllocator::releasePool(device, pool);
      throw;
    }
  };
  try {
    body();
  } catch (...) {
    try {
      end();
    } catch (...) {
    }
    throw;
  }
  end();
  impl_->captured = true;
}

void StepGraph::replay() {
  impl_->graph.replay();
}

#else

bool cuda_graphs_built() {
  return false;
}

void use_on_current_stream(const torch::Tensor&) {}

struct SideStream::Impl {};
struct SideStream::Use::Impl {};
struct StepGraph::Impl {
  bool captured = false;
};

SideStream::Impl* no_cuda() {
  throw ConfigError("this flotilla was built against a LibTorch without CUDA: no CUDA graphs");
}

void StepGraph::capture(const std::function<void()>&) {
  no_cuda();
}

void StepGraph::replay() {
  no_cuda();
}

#endif

#ifndef FLOTILLA_WITH_CUDA
SideStream::SideStream(const torch::Device&) : impl_(no_cuda()) {}
SideStream::Use::Use(SideStream&) {
  no_cuda();
}
SideStream::Use::~Use() = default;
#endif
SideStream::~SideStream() = default;

StepGraph::StepGraph() : impl_(std::make_unique<Impl>()) {}
StepGraph::~StepGraph() = default;

bool StepGraph::captured() const {
  return impl_->captured;
}

} // namespace flotilla::train::detail
