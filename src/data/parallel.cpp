// Parallel map and parallel batch: a runner thread pulls work units from the input (one element
// for map, up to batch_size for batch) and hands each to the pool; the consumer takes results in
// input order (deterministic) or as they finish. Parallelism is fixed, or an AUTOTUNE knob.
#include <condition_variable>
#include <deque>
#include <thread>

#include "data/stages.h"
#include "data/thread_pool.h"
#include "data/tuner.h"

namespace flotilla::data::detail {
namespace {

class ParallelStage : public UnaryStage {
public:
  using Work = std::function<Element(std::vector<Element>&&, std::int64_t index)>;

  ParallelStage(std::string name, std::unique_ptr<Stage> input, std::int64_t unit_size,
                bool drop_partial, std::int64_t parallel, bool deterministic,
                const IteratorContext& ctx, Work work)
      : UnaryStage(std::move(name), std::move(input)), unit_size_(unit_size),
        drop_partial_(drop_partial), deterministic_(deterministic),
        autotuned_(parallel == kAutotune), pool_(ctx.pool), tuner_(ctx.tuner),
        work_(std::move(work)),
        knob_(autotuned_ ? std::min<std::int64_t>(2, ctx.pool->size()) : parallel,
              autotuned_ ? ctx.pool->size() : parallel, 0) {
    if (autotuned_)
      tuner_->add(&knob_);
  }

  ~ParallelStage() override {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      cancelled_ = true;
    }
    changed_.notify_all();
    if (runner_.joinable())
      runner_.join();
    // Tasks on the pool hold `this`: wait for them before the members go.
    std::unique_lock<std::mutex> lock(mutex_);
    changed_.wait(lock, [&] { return in_flight_ == 0; });
    lock.unlock();
    if (autotuned_)
      tuner_->remove(&knob_);
  }

  std::int64_t skip(std::int64_t n) override {
    if (runner_.joinable())
      return Stage::skip(n); // results are in flight: take them in order
    const std::int64_t moved = input_->skip(n * unit_size_); // functions are pure
    next_index_ += (moved + unit_size_ - 1) / unit_size_;
    return moved / unit_size_ + (!drop_partial_ && moved % unit_size_ != 0 ? 1 : 0);
  }

protected:
  std::optional<Element> produce() override {
    if (!runner_.joinable())
      runner_ = std::thread([this] { run(); });
    std::unique_lock<std::mutex> lock(mutex_);
    const auto start = Clock::now();
    std::shared_ptr<Slot> slot;
    for (;;) {
      if (deterministic_) {
        if (!slots_.empty() && slots_.front()->ready) {
          slot = slots_.front();
          slots_.pop_front();
        }
      } else {
        for (auto it = slots_.begin(); it != slots_.end(); ++it) {
          if ((*it)->ready) {
            slot = *it;
            slots_.erase(it);
            break;
          }
        }
      }
      if (slot || (slots_.empty() && input_done_))
        break;
      changed_.wait(lock);
    }
    const auto waited =
        std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - start).count();
    knob_.counters().consumer_wait_ns += waited;
    knob_.counters().consumer_wait_total_ns += waited;
    lock.unlock();
    changed_.notify_all(); // room for the runner
    if (!slot)
      return std::nullopt;
    if (slot->error)
      std::rethrow_exception(slot->error);
    knob_.observe_element_bytes(element_bytes(*slot->result));
    return std::move(slot->result);
  }

  void fill(StageStats& s) const override {
    s.parallelism = knob_.value();
    s.buffer_size = knob_.value();
    s.autotuned = autotuned_;
    s.consumer_wait_share = share(knob_.counters().consumer_wait_total_ns.load());
  }

private:
  struct Slot {
    std::int64_t index = 0;
    bool ready = false;
    std::optional<Element> result;
    std::exception_ptr error;
  };

  void run() {
    for (;;) {
      std::unique_lock<std::mutex> lock(mutex_);
      const auto start = Clock::now();
      changed_.wait(lock, [&] {
        return cancelled_ || static_cast<std::int64_t>(slots_.size()) < knob_.value();
      });
      knob_.counters().producer_full_ns +=
          std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - start).count();
      if (cancelled_)
        return;
      lock.unlock();

      std::vector<Element> unit;
      std::exception_ptr error;
      try {
        while (static_cast<std::int64_t>(unit.size()) < unit_size_) {
          auto e = input_->next();
          if (!e)
            break;
          unit.push_back(std::move(*e));
        }
      } catch (...) {
        error = std::current_exception();
      }
      const bool end =
          !error &&
          (unit.empty() || (drop_partial_ && static_cast<std::int64_t>(unit.size()) < unit_size_));
      lock.lock();
      if (error) {
        auto slot = std::make_shared<Slot>();
        slot->ready = true;
        slot->error = error;
        slots_.push_back(slot);
      }
      if (error || end) {
        input_done_ = true;
        lock.unlock();
        changed_.notify_all();
        return;
      }
      auto slot = std::make_shared<Slot>();
      slot->index = next_index_++;
      slots_.push_back(slot);
      ++in_flight_;
      lock.unlock();
      pool_->submit([this, slot, unit = std::move(unit)]() mutable {
        std::optional<Element> result;
        std::exception_ptr error;
        try {
          result = work_(std::move(unit), slot->index);
        } catch (...) {
          error = std::current_exception();
        }
        {
          std::lock_guard<std::mutex> guard(mutex_);
          slot->result = std::move(result);
          slot->error = error;
          slot->ready = true;
          --in_flight_;
        }
        changed_.notify_all();
      });
    }
  }

  const std::int64_t unit_size_;
  const bool drop_partial_;
  const bool deterministic_;
  const bool autotuned_;
  std::shared_ptr<ThreadPool> pool_;
  std::shared_ptr<Tuner> tuner_;
  Work work_;
  Knob knob_;

  std::mutex mutex_;
  std::condition_variable changed_;
  std::deque<std::shared_ptr<Slot>> slots_;
  std::int64_t next_index_ = 0;
  std::int64_t in_flight_ = 0;
  bool input_done_ = false;
  bool cancelled_ = false;
  std::thread runner_;
};

} // namespace

std::unique_ptr<Stage> make_parallel_map(std::unique_ptr<Stage> input, MapFn fn,
                                         std::int64_t parallel, bool deterministic,
                                         const IteratorContext& ctx) {
  return std::make_unique<ParallelStage>(
      "ParallelMap", std::move(input), 1, false, parallel, deterministic, ctx,
      [fn = std::move(fn)](std::vector<Element>&& unit, std::int64_t index) {
        try {
          return fn(std::move(unit.front()));
        } catch (...) {
          throw map_failure(index, std::current_exception());
        }
      });
}

std::unique_ptr<Stage> make_parallel_batch(std::unique_ptr<Stage> input, std::int64_t size,
                                           bool drop_remainder, std::int64_t parallel,
                                           const IteratorContext& ctx) {
  // Batches are assembled in parallel but always returned in order.
  return std::make_unique<ParallelStage>(
      "ParallelBatch", std::move(input), size, drop_remainder, parallel, true, ctx,
      [](std::vector<Element>&& unit, std::int64_t index) { return stack_batch(unit, index); });
}

} // namespace flotilla::data::detail
