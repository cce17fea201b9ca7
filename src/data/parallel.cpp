// Parallel map and parallel batch: a runner thread pulls work units from the input and hands each
// to the pool; the consumer takes results in input order (deterministic) or as they finish.
// A map unit is a chunk of consecutive elements, sized so that a task runs ~200 µs: a cheap
// per-element function then costs one task hand-off per chunk rather than per element, which is
// what lets element-wise preprocessing keep up with tf.data's C++ kernels. A batch unit is
// batch_size elements. Parallelism (units in flight) is fixed, or an AUTOTUNE knob.
//
// Errors are results too: a function that throws on element k yields an error in k's place and
// the elements after it still come, as with the sequential map; an input error is passed on in
// its place and the runner goes on reading.
#include <condition_variable>
#include <deque>
#include <thread>

#include "data/stages.h"
#include "flotilla/base/thread_pool.h"
#include "data/tuner.h"

namespace flotilla::data::detail {
namespace {

class ParallelStage : public UnaryStage {
 public:
  // Turns a unit of input elements (the first being element `first_index` of this pass) into
  // results appended to `out`, one per output element or error.
  using Work = std::function<void(std::vector<Element>& unit, std::int64_t first_index,
                                  std::deque<Result>& out)>;

  ParallelStage(std::string name, std::unique_ptr<Stage> input, bool chunked,
                std::int64_t unit_size, bool drop_partial, std::int64_t parallel,
                bool deterministic, const IteratorContext& ctx, Work work)
      : UnaryStage(std::move(name), std::move(input)), chunked_(chunked), unit_size_(unit_size),
        drop_partial_(drop_partial), deterministic_(deterministic),
        autotuned_(parallel == kAutotune), pool_(ctx.pool), tuner_(ctx.tuner),
        work_(std::move(work)),
        knob_(autotuned_ ? std::min<std::int64_t>(2, ctx.pool->size()) : parallel,
              autotuned_ ? ctx.pool->size() : parallel, 0) {
    if (autotuned_) tuner_->add(&knob_);
  }

  ~ParallelStage() override {
    std::unique_lock<std::mutex> lock(mutex_);
    cancelled_ = true;
    space_.notify_all();
    lock.unlock();
    if (runner_.joinable()) runner_.join();
    // Tasks on the pool hold `this`: wait until the last one has let go of the lock.
    lock.lock();
    space_.wait(lock, [&] { return in_flight_ == 0; });
    lock.unlock();
    if (autotuned_) tuner_->remove(&knob_);
  }

  std::int64_t skip(std::int64_t n) override {
    if (runner_.joinable()) return Stage::skip(n); // results are in flight: take them in order
    if (chunked_) {                                // map functions are pure: run nothing
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
    if (!runner_.joinable()) runner_ = std::thread([this] { run(); });
    std::unique_lock<std::mutex> lock(mutex_);
    const auto start = Clock::now();
    std::shared_ptr<Slot> slot;
    for (;;) {
      if (deterministic_) {
        if (!slots_.empty() && slots_.front()->ready) slot = slots_.front();
      } else {
        for (const auto& s : slots_) {
          if (s->ready) {
            slot = s;
            break;
          }
        }
      }
      if (slot || (slots_.empty() && input_done_)) break;
      ready_.wait(lock);
    }
    const auto waited =
        std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - start).count();
    knob_.counters().consumer_wait_ns += waited;
    knob_.counters().consumer_wait_total_ns += waited;
    if (!slot) return std::nullopt;
    Result result = std::move(slot->results.front());
    slot->results.pop_front();
    if (slot->results.empty()) {
      slots_.erase(std::find(slots_.begin(), slots_.end(), slot));
      space_.notify_one(); // room for the runner
    }
    lock.unlock();
    if (result.error) std::rethrow_exception(result.error);
    knob_.observe_element_bytes(element_bytes(*result.element) *
                                (chunked_ ? chunk_.load() : std::int64_t{1}));
    return std::move(result.element);
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
    std::deque<Result> results; // never empty once ready
  };

  // Elements per map task: enough for ~200 µs of work, learned from the tasks so far.
  std::int64_t next_unit_size() const {
    if (!chunked_) return unit_size_;
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
      if (cancelled_) return;
      lock.unlock();

      const std::int64_t want = next_unit_size();
      std::vector<Element> unit;
      unit.reserve(static_cast<std::size_t>(want));
      std::exception_ptr error; // the input's, which comes after the unit's elements
      bool input_ended = false;
      try {
        while (static_cast<std::int64_t>(unit.size()) < want) {
          auto e = input_->next();
          if (!e) {
            input_ended = true;
            break;
          }
          unit.push_back(std::move(*e));
        }
      } catch (...) {
        error = std::current_exception();
      }
      const bool dropped = !chunked_ && drop_partial_ && input_ended &&
                           static_cast<std::int64_t>(unit.size()) < want;
      // A short last batch under drop_remainder is dropped; so is a batch cut by an input error
      // (the sequential batch loses it the same way).
      if (dropped || (!chunked_ && error)) unit.clear();
      lock.lock();
      const std::int64_t first = next_index_;
      next_index_ += static_cast<std::int64_t>(unit.size());
      if (!unit.empty() || error) {
        auto slot = std::make_shared<Slot>();
        slots_.push_back(slot);
        if (unit.empty()) { // only the input's error: ready now, in its place
          slot->results.push_back(Result{std::nullopt, error});
          slot->ready = true;
        } else {
          ++in_flight_;
          pool_->submit([this, slot, first, error, unit = std::move(unit)]() mutable {
            compute(*slot, unit, first, error);
          });
        }
      }
      if (input_ended) input_done_ = true;
      ready_.notify_all();
      if (input_ended) return;
    }
  }

  // On the pool: the unit's results, then the input's error if it had one.
  void compute(Slot& slot, std::vector<Element>& unit, std::int64_t first,
               std::exception_ptr input_error) {
    const auto start = Clock::now();
    const auto count = static_cast<std::int64_t>(unit.size());
    std::deque<Result> results;
    try {
      work_(unit, first, results);
    } catch (...) {
      results.push_back(Result{std::nullopt, std::current_exception()});
    }
    if (input_error) results.push_back(Result{std::nullopt, input_error});
    if (chunked_) {
      const auto ns =
          std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - start).count();
      const std::int64_t per = ns / std::max<std::int64_t>(1, count);
      const std::int64_t old = per_element_ns_.load();
      per_element_ns_.store(old <= 0 ? per : (3 * old + per) / 4);
    }
    // Notified under the lock: once in_flight_ drops to 0 the destructor may free everything.
    std::lock_guard<std::mutex> guard(mutex_);
    slot.results = std::move(results);
    slot.ready = true;
    --in_flight_;
    ready_.notify_all();
    space_.notify_all();
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
                           std::deque<Result>& out) {
        for (std::size_t k = 0; k < unit.size(); ++k) {
          try {
            out.push_back(Result{fn(std::move(unit[k])), nullptr});
          } catch (...) {
            out.push_back(Result{std::nullopt, std::make_exception_ptr(
                                                   map_failure(first + static_cast<std::int64_t>(k),
                                                               std::current_exception()))});
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
      ctx, [size](std::vector<Element>& unit, std::int64_t first, std::deque<Result>& out) {
        out.push_back(Result{stack_batch(unit, first / size), nullptr});
      });
}

} // namespace flotilla::data::detail
