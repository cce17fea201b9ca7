// Private: jit_compile on CUDA. The step's forward, backward and gradient all-reduce captured
// once in a CUDA graph, after a few eager warm-up steps (the allocator, cuBLAS and NCCL set
// themselves up then), and replayed for every batch of the captured shapes. The optimizer stays
// eager: LibTorch's optimizers read their learning rate and step count on the host, which a
// graph would freeze.
#pragma once

#include <torch/types.h>

#include <functional>
#include <optional>
#include <vector>

#include "flotilla/data/dataset.h"
#include "flotilla/log.h"
#include "train/step_graph.h"
#include "train/step_timer.h"

namespace flotilla::train::detail {

class CapturedStep {
 public:
  static constexpr int kWarmupSteps = 3;
  explicit CapturedStep(const torch::Device& device) : stream_(device), device_(device) {}

  // The gradient engine is made, and every step runs, on this side stream.
  SideStream& stream() { return stream_; }
  // Counts an eager warm-up step; true once they are done and steps replay.
  bool warmed_up() {
    if (eager_steps_ >= kWarmupSteps) return true;
    ++eager_steps_;
    return false;
  }

  // What one step does between the copy and the optimizer, on the graph's inputs and with its
  // loss factor (loss scale / replica share, changed without a re-capture); returns the batch
  // sums. Recorded by the first replay instead of run.
  using Body =
      std::function<torch::Tensor(const data::Element& inputs, const torch::Tensor& loss_factor)>;
  // Copies `batch` into the graph's inputs and replays the graph (capturing `body` first). The
  // batch sums, or nullopt where the batch's shapes differ from the captured ones (run it
  // eagerly). A failed capture calls `abort_step` and is a ConfigError. `chief` logs what
  // happens once, on the chief (null elsewhere).
  std::optional<torch::Tensor> replay(const data::Element& batch, double loss_factor,
                                      const Body& body, const std::function<void()>& abort_step,
                                      StepTimer& timer, const Logger* chief);

 private:
  SideStream stream_;
  torch::Device device_;
  StepGraph graph_;
  std::vector<torch::Tensor> inputs_; // static copies of the batch's components, read by the graph
  torch::Tensor loss_factor_;
  torch::Tensor sums_; // the captured step's batch sums, rewritten by each replay
  int eager_steps_ = 0;
  bool told_shapes_ = false; // said once that a batch of other shapes runs eagerly
};

} // namespace flotilla::train::detail
