// A fixed set of threads running queued tasks: the input pipeline's map functions and batch
// assembly (data/), a model's extra replicas (train/). Tasks run to completion; the destructor
// finishes what was queued and joins.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace flotilla::base {

class ThreadPool {
 public:
  explicit ThreadPool(int threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  // `task` must not throw (stages catch and carry the error to their consumer).
  void submit(std::function<void()> task);
  int size() const { return static_cast<int>(threads_.size()); }

 private:
  void work();
  void stop();

  std::mutex mutex_;
  std::condition_variable ready_;
  std::deque<std::function<void()>> tasks_;
  bool stopping_ = false;
  std::vector<std::thread> threads_;
};

} // namespace flotilla::base
