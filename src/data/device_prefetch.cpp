// prefetch_to_device: a prefetch whose producer thread also moves each element to a device, so
// that the host-to-device copy of the next batch overlaps the training step on this one.
//
// For CUDA the copy is issued from pinned memory on a stream from c10's pool (not the default
// stream, where the step's kernels run) and waited for on the producer thread, so an element in
// the buffer is complete: the consumer can use it on any stream without synchronizing.
//
// Memory: the destination is allocated on the copy stream and marked as used by the device's
// default stream (record_stream). When the consumer drops a batch, the caching allocator then
// holds its block until the default stream's work queued before that moment has finished, and
// only then hands it to the next copy. Allocating on the default stream instead would let the
// next copy (on the copy stream) overwrite a block that kernels still queued on the default
// stream read. A consumer that reads the tensors on a stream of its own records that stream,
// as with any CUDA tensor used off its allocation stream.
//
// Without a CUDA build of LibTorch (FLOTILLA_WITH_CUDA undefined) CUDA devices are refused at
// construction, like a machine without a visible GPU.
#include <torch/cuda.h>

#if defined(FLOTILLA_WITH_CUDA)
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include "data/read_ahead.h"
#include "data/stages.h"

namespace flotilla::data::detail {
namespace {

std::string describe_device_prefetch(const torch::Device& device, std::int64_t buffer_size) {
  return "prefetch_to_device(" + device.str() + ", " + std::to_string(buffer_size) + ")";
}

// Checks the device and returns it with its index filled in (a bare "cuda" means the current
// device, as torch::Tensor::to does).
torch::Device resolve_device(torch::Device device) {
  if (device.is_cpu()) return torch::Device(torch::kCPU);
  if (!device.is_cuda()) {
    throw ConfigError("prefetch_to_device: device " + device.str() +
                      " is not supported; use a CUDA device (e.g. torch::Device(\"cuda:0\")) or "
                      "torch::kCPU");
  }
#if defined(FLOTILLA_WITH_CUDA)
  const bool available = torch::cuda::is_available();
  const auto count = available ? static_cast<std::int64_t>(torch::cuda::device_count()) : 0;
#else
  const bool available = false;
  const std::int64_t count = 0;
#endif
  const std::int64_t index = device.has_index() ? device.index() : 0;
  if (!available || index >= count) {
    throw ConfigError(
        "prefetch_to_device: asked for " + (device.has_index() ? device.str() : "cuda") +
        " but this process sees " + std::to_string(count) + " CUDA device(s)" +
        (count > 0 ? " (cuda:0 to cuda:" + std::to_string(count - 1) + ")" : "") +
#if defined(FLOTILLA_WITH_CUDA)
        "; CUDA_VISIBLE_DEVICES selects which GPUs it sees (check it and the driver), or "
        "prefetch to torch::kCPU"
#else
        "; this build of LibTorch has no CUDA; prefetch to torch::kCPU"
#endif
    );
  }
#if defined(FLOTILLA_WITH_CUDA)
  if (!device.has_index()) return torch::Device(torch::kCUDA, c10::cuda::current_device());
#endif
  return device;
}

// Pulls from the input and moves each element to the device. Runs on the prefetch thread
// (ReadAhead calls next()), so the copy, and the wait for it, stay off the consumer's thread.
class DeviceCopy : public Stage {
 public:
  DeviceCopy(Stage& input, torch::Device device)
      : Stage("DeviceCopy"), input_(input), device_(device) {}

  std::int64_t skip(std::int64_t n) override {
    const std::int64_t moved = input_.skip(n);
    index_ += moved;
    return moved;
  }

 protected:
  std::optional<Element> produce() override {
    auto e = input_.next(); // an input error passes through as it is
    if (!e) return std::nullopt;
    const std::int64_t index = index_++;
    try {
      return device_.is_cuda() ? to_cuda(std::move(*e)) : to_cpu(std::move(*e));
    } catch (...) {
      throw DataError(
          "prefetch_to_device(" + device_.str() + "): moving element " + std::to_string(index) +
          " of this pass to the device failed: " + describe_exception(std::current_exception()));
    }
  }

 private:
  static Element to_cpu(Element e) {
    for (auto& t : e) {
      if (t.defined()) t = t.to(torch::kCPU); // returns t itself when it is on the CPU already
    }
    return e;
  }

  Element to_cuda(Element e) {
#if defined(FLOTILLA_WITH_CUDA)
    const c10::cuda::CUDAGuard device_guard(device_);
    // From the high-priority pool: the low-priority one holds jit_compile's side stream, and the
    // pools hand their streams out round-robin, a new one per pass.
    if (!copy_stream_) copy_stream_ = c10::cuda::getStreamFromPool(true, device_.index());
    const c10::cuda::CUDAStream default_stream = c10::cuda::getDefaultCUDAStream(device_.index());
    bool copied = false;
    {
      const c10::cuda::CUDAStreamGuard on_copy_stream(*copy_stream_);
      for (auto& t : e) {
        if (!t.defined() || t.device() == device_) continue;
        if (!t.is_cpu() || t.layout() != torch::kStrided) {
          // Another GPU's or a sparse tensor: rare enough for a plain copy (ordered on this
          // stream, so the event below covers it too).
          t = t.to(device_);
          if (t.layout() == torch::kStrided) t.record_stream(default_stream); // needs storage
          copied = true;
          continue;
        }
        // Only a copy from page-locked memory is asynchronous; pin_memory is a host memcpy.
        const torch::Tensor pinned = t.is_pinned() ? t : t.pin_memory();
        torch::Tensor dst = torch::empty_like(pinned, torch::TensorOptions().device(device_));
        dst.copy_(pinned, /*non_blocking=*/true);
        dst.record_stream(default_stream);
        t = std::move(dst);
        copied = true;
      }
    }
    if (copied) {
      copied_.record(*copy_stream_);
      copied_.synchronize(); // blocks this thread only; the element is complete once buffered
    }
    return e;
#else
    throw ConfigError("prefetch_to_device: this build of LibTorch has no CUDA"); // unreachable
#endif
  }

  Stage& input_;
  const torch::Device device_;
  std::int64_t index_ = 0; // elements taken from the input in this pass, for messages
#if defined(FLOTILLA_WITH_CUDA)
  std::optional<c10::cuda::CUDAStream> copy_stream_; // taken on the first copy, on this thread
  at::cuda::CUDAEvent copied_;                       // created on its first record
#endif
};

class DevicePrefetchStage : public UnaryStage {
 public:
  DevicePrefetchStage(std::unique_ptr<Stage> input, torch::Device device, std::int64_t buffer_size)
      : UnaryStage("PrefetchToDevice", std::move(input)), buffer_size_(buffer_size),
        copy_(*input_, device), reader_(
                                    copy_, [this] { return buffer_size_; }, &counters_) {}
  // reader_ stops its thread before copy_ and input_ go (members go in reverse order).

  std::int64_t skip(std::int64_t n) override {
    // Elements already read ahead are in the buffer: take them in order. Before the thread
    // starts (a resume), the input skips without copying anything.
    if (reader_.started()) return Stage::skip(n);
    return copy_.skip(n);
  }

 protected:
  std::optional<Element> produce() override { return reader_.next(); }
  void fill(StageStats& s) const override {
    s.buffer_size = buffer_size_;
    s.consumer_wait_share = share(counters_.consumer_wait_total_ns.load());
  }

 private:
  const std::int64_t buffer_size_;
  WaitCounters counters_;
  DeviceCopy copy_;
  ReadAhead reader_;
};

class DevicePrefetchNode : public UnaryNode {
 public:
  DevicePrefetchNode(NodePtr input, torch::Device device, std::int64_t buffer_size)
      : UnaryNode(std::move(input)), device_(device), buffer_size_(buffer_size) {
    if (buffer_size < 1) {
      throw ConfigError("prefetch_to_device buffer_size must be at least 1; saw " +
                        std::to_string(buffer_size) +
                        " (1 already overlaps the next element's copy with the current step)");
    }
    device_ = resolve_device(device);
  }
  std::unique_ptr<Stage> make_iterator(const IteratorContext& ctx) const override {
    return std::make_unique<DevicePrefetchStage>(input_->make_iterator(ctx), device_, buffer_size_);
  }
  std::int64_t cardinality() const override { return input_->cardinality(); }
  std::string describe() const override { return describe_device_prefetch(device_, buffer_size_); }
  // Workers prefetch to their own GPUs, and a resumed pass may use another: the same elements.
  std::string fingerprint_text() const override { return "prefetch_to_device"; }
  // Element k out is element k in: distribute_dataset rewrites the batch below it.
  bool preserves_order(const Options&) const override { return true; }
  NodePtr with_inputs(std::vector<NodePtr> inputs) const override {
    return std::make_shared<DevicePrefetchNode>(inputs.at(0), device_, buffer_size_);
  }

 private:
  torch::Device device_;
  std::int64_t buffer_size_;
};

} // namespace

NodePtr make_prefetch_to_device(NodePtr input, torch::Device device, std::int64_t buffer_size) {
  return std::make_shared<DevicePrefetchNode>(std::move(input), device, buffer_size);
}

} // namespace flotilla::data::detail
