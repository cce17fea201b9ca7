#include "train/captured_step.h"

#include <ATen/autocast_mode.h>

#include "flotilla/error.h"

namespace flotilla::train::detail {

std::optional<torch::Tensor> CapturedStep::replay(const data::Element& batch, double loss_factor,
                                                  const Body& body,
                                                  const std::function<void()>& abort_step,
                                                  StepTimer& timer, const Logger* chief) {
  if (graph_.captured()) {
    bool same = batch.size() == inputs_.size();
    for (std::size_t k = 0; same && k < batch.size(); ++k) {
      same = batch[k].sizes() == inputs_[k].sizes() &&
             batch[k].scalar_type() == inputs_[k].scalar_type();
    }
    if (!same) {
      if (!told_shapes_ && chief) {
        chief->info("jit_compile: a batch of shape " + c10::str(batch[0].sizes()) +
                    " differs from the captured " + c10::str(inputs_[0].sizes()) +
                    "; such batches run eagerly (batch with drop_remainder for one shape)");
      }
      told_shapes_ = true;
      return std::nullopt;
    }
  } else {
    for (const auto& t : batch) inputs_.push_back(torch::empty_like(t));
    loss_factor_ = torch::ones({}, torch::TensorOptions().device(device_));
  }
  for (std::size_t k = 0; k < batch.size(); ++k) inputs_[k].copy_(batch[k], /*non_blocking=*/true);
  loss_factor_.fill_(loss_factor);
  timer.mark(Phase::kCopy);
  if (!graph_.captured()) {
    try {
      graph_.capture([&] {
        // Casts cached across the capture's edge would be stale on replay.
        const bool cache = at::autocast::is_autocast_cache_enabled();
        at::autocast::set_autocast_cache_enabled(false);
        try {
          sums_ = body(inputs_, loss_factor_);
        } catch (...) {
          at::autocast::set_autocast_cache_enabled(cache);
          throw;
        }
        at::autocast::set_autocast_cache_enabled(cache);
      });
    } catch (const std::exception& e) {
      // Fatal: the other workers may have captured their all-reduces, and stepping on eagerly
      // would leave them waiting for collectives this worker never issues.
      abort_step();
      throw ConfigError(std::string("jit_compile: capturing the step in a CUDA graph failed (") +
                        e.what() +
                        "); a step that reads values back to the host (a parameter some replica "
                        "leaves unused, a metric or callback that copies to the CPU) cannot be "
                        "captured. Run without CompileOptions::jit_compile");
    }
    if (chief) {
      chief->info("jit_compile: the step's forward, backward and all-reduce are captured in a "
                  "CUDA graph (batch " +
                  c10::str(batch[0].sizes()) + "); the optimizer runs eagerly");
    }
  }
  graph_.replay();
  timer.mark(Phase::kBackward);
  return sums_;
}

} // namespace flotilla::train::detail
