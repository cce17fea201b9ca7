#include "data/read_ahead.h"

namespace flotilla::data::detail {

ReadAhead::ReadAhead(Stage& input, std::function<std::int64_t()> capacity, WaitCounters* counters,
                     std::function<void(const Element&)> on_element)
    : input_(input), capacity_(std::move(capacity)), counters_(counters),
      on_element_(std::move(on_element)) {}

ReadAhead::~ReadAhead() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    cancelled_ = true;
    changed_.notify_all();
  }
  if (thread_.joinable()) thread_.join();
}

std::optional<Element> ReadAhead::next() {
  if (!thread_.joinable()) thread_ = std::thread([this] { run(); });
  std::unique_lock<std::mutex> lock(mutex_);
  const auto start = Clock::now();
  changed_.wait(lock, [&] { return !buffer_.empty() || done_; });
  if (counters_) {
    const auto waited =
        std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - start).count();
    counters_->consumer_wait_ns += waited;
    counters_->consumer_wait_total_ns += waited;
  }
  if (buffer_.empty()) return std::nullopt;
  Result out = std::move(buffer_.front());
  buffer_.pop_front();
  changed_.notify_all();
  lock.unlock();
  if (out.error) std::rethrow_exception(out.error);
  return std::move(out.element);
}

bool ReadAhead::ready() {
  if (!thread_.joinable()) thread_ = std::thread([this] { run(); });
  std::lock_guard<std::mutex> lock(mutex_);
  return !buffer_.empty() || done_;
}

void ReadAhead::run() {
  for (;;) {
    std::unique_lock<std::mutex> lock(mutex_);
    const auto start = Clock::now();
    changed_.wait(lock, [&] {
      return cancelled_ || static_cast<std::int64_t>(buffer_.size()) < capacity_();
    });
    if (counters_) {
      counters_->producer_full_ns +=
          std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - start).count();
    }
    if (cancelled_) return;
    lock.unlock();
    Result r;
    try {
      r.element = input_.next();
    } catch (...) {
      r.error = std::current_exception();
    }
    if (r.element && on_element_) on_element_(*r.element);
    lock.lock();
    if (!r.element && !r.error) {
      done_ = true;
      changed_.notify_all();
      return;
    }
    buffer_.push_back(std::move(r));
    changed_.notify_all();
  }
}

}  // namespace flotilla::data::detail
