// Private: the CUDA-graph pieces of jit_compile. A captured training step replays forward,
// backward and the gradient all-reduce as one graph launch, so the host's per-kernel launch cost
// (most of a small model's step on a fast GPU) is paid once, at capture. Built where LibTorch
// has CUDA; elsewhere available() is false and the constructors throw.
#pragma once

#include <torch/types.h>

#include <functional>
#include <memory>

namespace flotilla::train::detail {

// Whether this build can capture CUDA graphs (LibTorch with CUDA).
bool cuda_graphs_built();

// A side stream of `device`: graphs cannot be captured on the default stream, and the
// gradient engine's hooks, warm-up, capture and replay must all use one stream (autograd runs
// a parameter's gradient accumulation on the stream current when its accumulator was made).
class SideStream {
 public:
  explicit SideStream(const torch::Device& device);
  ~SideStream();
  SideStream(const SideStream&) = delete;
  SideStream& operator=(const SideStream&) = delete;

  // Makes the side stream current on this thread while alive: it starts after the work queued
  // on the default stream, and the default stream goes on after the side stream's work.
  class Use {
   public:
    explicit Use(SideStream& side);
    ~Use();
    Use(const Use&) = delete;
    Use& operator=(const Use&) = delete;

   private:
    struct Impl;
    std::unique_ptr<Impl> impl_;
  };

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Tells the caching allocator that `t` (a CUDA tensor made on another stream, such as a batch
// from prefetch_to_device) is also used on this thread's current stream, so its memory is not
// reused before the work queued there is done. Nothing for other tensors.
void use_on_current_stream(const torch::Tensor& t);

class StepGraph {
 public:
  StepGraph();
  ~StepGraph();
  StepGraph(const StepGraph&) = delete;
  StepGraph& operator=(const StepGraph&) = delete;

  // Records `body` (which only queues work: no host synchronisation, no allocation outside the
  // graph's pool that must outlive it) on the current stream. Nothing runs until replay(). If
  // the body or the capture fails, the capture is ended, its memory pool released and the
  // error rethrown.
  void capture(const std::function<void()>& body);
  void replay();
  bool captured() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

} // namespace flotilla::train::detail
