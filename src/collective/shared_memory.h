// Private: an all-reduce through shared memory for the ranks of one group that share a host
// (CommunicationOptions::shared_memory). Rank 0 makes a POSIX shared-memory segment, the others
// map it, and rank 0 unlinks its name once every rank has tried (or a wait for one failed), so
// nothing is left in /dev/shm when the processes end; a rank 0 killed before that leaves
// "flotilla-<pid namespace>-<pid>-<nonce>", which the next rank 0 of this user and namespace
// removes once that pid no longer runs. Per chunk of at most 4 MiB: each rank copies its tensor
// into its slot, waits for every rank's, sums its share of the chunk into the result, waits again,
// and copies the whole result back. Every rank ends with the same bits. It runs on the calling
// thread: no thread hand-off and no TCP on the way, where Gloo's ring over loopback costs
// milliseconds.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

namespace flotilla::collective::detail {

class SharedMemoryReduce {
 public:
  // Meets the other ranks through `store` (keys "host/<rank>", "name", "ok/<rank>"): nullptr,
  // with `why` set, unless every rank runs on this host (the same boot, and the same network,
  // IPC and mount namespaces) and mapped the segment rank 0 made. Every rank gets the same
  // answer.
  static std::unique_ptr<SharedMemoryReduce> open(c10d::Store& store, int rank, int size,
                                                  std::string& why);
  ~SharedMemoryReduce();
  SharedMemoryReduce(const SharedMemoryReduce&) = delete;
  SharedMemoryReduce& operator=(const SharedMemoryReduce&) = delete;

  // Whether all_reduce takes `tensor`: contiguous, on the CPU, float32/64, bfloat16, float16 or
  // a 32/64-bit integer.
  static bool takes(const at::Tensor& tensor);
  // `tensor` (takes() holds) reduced in place with every rank's, SUM, MAX or MIN. While it waits
  // for the others it calls `poll`, which throws to stop it (the group failed); after `timeout`
  // without them it throws a "Timed out" std::runtime_error naming the ranks that had not
  // arrived. After a throw every later call throws: the others' place is unknown.
  void all_reduce(const at::Tensor& tensor, c10d::ReduceOp::RedOpType op,
                  std::chrono::milliseconds timeout, const std::function<void()>& poll);

  // all_reduce as a completed c10d::Work (its failure rethrown by wait() and set on its future),
  // so a Communicator treats it as any backend's.
  c10::intrusive_ptr<c10d::Work> run(const at::Tensor& tensor, c10d::ReduceOp::RedOpType op,
                                     std::chrono::milliseconds timeout,
                                     const std::function<void()>& poll);

  // Seconds this rank's all-reduces have waited for the other ranks so far.
  double waited_seconds() const;

  struct Segment;

 private:
  explicit SharedMemoryReduce(std::unique_ptr<Segment> segment);
  std::unique_ptr<Segment> segment_;
};

} // namespace flotilla::collective::detail
