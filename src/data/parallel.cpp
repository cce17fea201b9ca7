// Parallel map and parallel batch: a runner thread pulls work units from the input and hands each
// to the pool; the consumer takes results in input order (deterministic) or as they finish.
// A map unit is a chunk of consecutive elements, sized so that a task runs ~200 µs: a cheap
// per-element function then costs one task hand-off per chunk rather than per element, which is
// what lets element-wise preprocessing keep up with tf.data's C++ kernels. A batch unit is
// batch_size elements. Parallelism (units in flight) is fixed, or an AUTOTUNE knob.
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
  // Turns a unit of input elements (the first being element `first_index` of this pass) into
  // output elements appended to `out`; may throw after appending some.
  using Work = std::function<void(std::vector<Element>& unit, std::int64_t first_index,
                                  std::deque<Element>& out)>;

  ParallelStage(std::string name, std::unique_ptr<Stage> input, bool chunked,
                std::int64_t unit_size, bool drop_partial, std::int64_t parallel,
                bool deterministic, const IteratorContext& ctx, Work work)
      : UnaryStage(std::move(name), std::move(input)), chunked_(chunked), unit_size_(unit_size),
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
    space_.notify_all();
    if (runner_.joinable())
      runner_.join();
    // Tasks on the pool hold `this`: wait for them before the members go.
    std::unique_lock<std::mutex> lock(mutex_);
    space_.wait(lock, [&] { return in_flight_ == 0; });
    lock.unlock();
    if (autotuned_)
      tuner_->remove(&knob_);
  }

  std::int64_t skip(std::int64_t n) override {
    if (runner_.joinable())
      return Stage::skip(n); // results are in flight: take them in order
    if (chunked_) {          // map functions are pure: move the input, run nothing
      const std::int64_t moved = input_->skip(n);
      next_index_ += moved;
      return moved;
    }
    const std::int64_t moved = input_->skip(n * unit_size_);
    next_index_ += moved;
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
        if (!slots_.empty() && slots_.front()->ready)
          slot = slots_.front();
      } else {
        for (const auto& s : slots_) {
          if (s->ready) {
            slot = s;
            break;
          }
        }
      }
      if (slot || (slots_.empty() && input_done_))
        break;
      ready_.wait(lock);
    }
    const auto waited =
        std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - start).count();
    knob_.counters().consumer_wait_ns += waited;
    knob_.counters().consumer_wait_total_ns += waited;
    if (!slot)
      return std::nullopt;
    std::optional<Element> out;
    if (!slot->results.empty()) {
      out = std::move(slot->results.front());
      slot->results.pop_front();
    }
    // A unit that failed part-way gives its results first; its error comes on the next call.
    const bool finished = slot->results.empty() && (!out || !slot->error);
    const std::exception_ptr error = finished ? slot->error : nullptr;
    if (finished) {
      slots_.erase(std::find(slots_.begin(), slots_.end(), slot));
      lock.unlock();
      space_.notify_one(); // room for the runner
    }
    if (out) {
      knob_.observe_element_bytes(element_bytes(*out) *
                                  (chunked_ ? chunk_.load() : std::int64_t{1}));
      return out;
    }
    if (error)
      std::rethrow_exception(error);
    return produce(); // an empty unit (all filtered out upstream): take the next
  }

  void fill(StageStats& s) const override {
    s.parallelism = knob_.value();
    s.buffer_size = knob_.value() * (chunked_ ? chunk_.load() : std::int64_t{1});
    s.autotuned = autotuned_;
    s.consumer_wait_share = share(knob_.counters().consumer_wait_total_ns.load());
  }

private:
  struct Slot {
    bool ready = false;
    std::deque<Element> results;
    std::exception_ptr error;
  };

  // Elements per map task: enough for ~200 µs of work, learned from the tasks so far.
  std::int64_t next_unit_size() const {
    if (!chunked_)
      return unit_size_;
    constexpr std::int64_t kTaskNs = 200000;
    const std::int64_t per_element = per_element_ns_.load();
    const std::int64_t chunk =
        per_element <= 0 ? 1 : std::clamp<std::int64_t>(kTaskNs / per_element, 1, 64);
    chunk_.store(chunk);
    return chunk;
  }

  void run() {
    for (;;) {
      std::unique_lock<std::mutex> lock(mutex_);
      const auto start = Clock::now();
      space_.wait(lock, [&] {
        return cancelled_ || static_cast<std::int64_t>(slots_.size()) < knob_.value();
      });
      knob_.counters().producer_full_ns +=
          std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - start).count();
      if (cancelled_)
        return;
      lock.unlock();

      const std::int64_t want = next_unit_size();
      std::vector<Element> unit;
      unit.reserve(static_cast<std::size_t>(want));
      std::exception_ptr error;
      try {
        while (static_cast<std::int64_t>(unit.size()) < want) {
          auto e = input_->next();
          if (!e)
            break;
          unit.push_back(std::move(*e));
        }
      } catch (...) {
        error = std::current_exception();
      }
      const bool short_unit = static_cast<std::int64_t>(unit.size()) < want;
      const bool dropped = !chunked_ && drop_partial_ && short_unit;
      const bool end = error || short_unit; // a short unit is the input's last
      lock.lock();
      auto slot = std::make_shared<Slot>();
      slots_.push_back(slot);
      const std::int64_t first = next_index_;
      next_index_ += static_cast<std::int64_t>(unit.size());
      const bool compute = !unit.empty() && !dropped;
      if (compute) {
        ++in_flight_;
      } else if (error) { // nothing to compute: the slot carries the input's error, in order
        slot->ready = true;
        slot->error = error;
      } else {
        slots_.pop_back();
      }
      if (end)
        input_done_ = true;
      lock.unlock();
      ready_.notify_all();
      if (compute) {
        pool_->submit([this, slot, first, error, unit = std::move(unit)]() mutable {
          const auto work_start = Clock::now();
          const auto count = static_cast<std::int64_t>(unit.size());
          std::deque<Element> results;
          std::exception_ptr failure;
          try {
            work_(unit, first, results);
          } catch (...) {
            failure = std::current_exception();
          }
          if (chunked_) {
            const auto ns =
                std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - work_start)
                    .count();
            const std::int64_t per = ns / std::max<std::int64_t>(1, count);
            const std::int64_t old = per_element_ns_.load();
            per_element_ns_.store(old <= 0 ? per : (3 * old + per) / 4);
          }
          {
            std::lock_guard<std::mutex> guard(mutex_);
            slot->results = std::move(results);
            slot->error = failure ? failure : error; // the input's error comes after the unit
            slot->ready = true;
            --in_flight_;
          }
          ready_.notify_all();
          space_.notify_all(); // the destructor may be waiting for the last task
        });
      }
      if (end)
        return;
    }
  }

  const bool chunked_;
  const std::int64_t unit_size_;
  const bool drop_partial_;
  const bool deterministic_;
  const bool autotuned_;
  std::shared_ptr<ThreadPool> pool_;
  std::shared_ptr<Tuner> tuner_;
  Work work_;
  Knob knob_;
  std::atomic<std::int64_t> per_element_ns_{0};
  mutable std::atomic<std::int64_t> chunk_{1};

  std::mutex mutex_;
  std::condition_variable ready_; // a slot became ready, or the input ended
  std::condition_variable space_; // a slot was taken, or a task finished
  std::deque<std::shared_ptr<Slot>> slots_;
  std::int64_t next_index_ = 0; // input elements handed out so far
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
      "ParallelMap", std::move(input), /*chunked=*/true, 1, false, parallel, deterministic, ctx,
      [fn = std::move(fn)](std::vector<Element>& unit, std::int64_t first,
                           std::deque<Element>& out) {
        for (std::size_t k = 0; k < unit.size(); ++k) {
          try {
            out.push_back(fn(std::move(unit[k])));
          } catch (...) {
            throw map_failure(first + static_cast<std::int64_t>(k), std::current_exception());
          }
        }
      });
}

std::unique_ptr<Stage> make_parallel_batch(std::unique_ptr<Stage> input, std::int64_t size,
                                           bool drop_remainder, std::int64_t parallel,
                                           const IteratorContext& ctx) {
  // Batches are assembled in parallel but always returned in order.
  return std::make_unique<ParallelStage>(
      "ParallelBatch", std::move(input), /*chunked=*/false, size, drop_remainder, parallel, true,
      ctx, [size](std::vector<Element>& unit, std::int64_t first, std::deque<Element>& out) {
        out.push_back(stack_batch(unit, first / size));
      });
}

} // namespace flotilla::data::detail
