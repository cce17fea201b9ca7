// Private: a thread that reads a stage ahead of its consumer into a bounded buffer — prefetch's
// producer, and each open dataset of a parallel interleave. Errors are buffered in their place
// and reading goes on after them; the destructor stops and joins the thread.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <thread>

#include "data/stages.h"
#include "data/tuner.h"

namespace flotilla::data::detail {

class ReadAhead {
 public:
  // `capacity` is read each time the buffer might have room (an AUTOTUNE knob may change it);
  // `counters`, when given, collect the consumer's waits and the producer's full-buffer time;
  // `on_element` sees each element read (for the knob's bytes per element).
  ReadAhead(Stage& input, std::function<std::int64_t()> capacity, WaitCounters* counters = nullptr,
            std::function<void(const Element&)> on_element = nullptr);
  ~ReadAhead();
  ReadAhead(const ReadAhead&) = delete;
  ReadAhead& operator=(const ReadAhead&) = delete;

  bool started() const { return thread_.joinable(); }
  // The next element; nullopt at the end; rethrows an error in its place. Starts the thread.
  std::optional<Element> next();
  // Whether next() would return without waiting.
  bool ready();

 private:
  void run();

  Stage& input_;
  std::function<std::int64_t()> capacity_;
  WaitCounters* counters_;
  std::function<void(const Element&)> on_element_;
  std::mutex mutex_;
  std::condition_variable changed_;
  std::deque<Result> buffer_;
  bool done_ = false;
  bool cancelled_ = false;
  std::thread thread_;
};

}  // namespace flotilla::data::detail
