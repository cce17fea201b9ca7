// Collectives across the workers of a cluster. A Communicator is a cheap value handle over one
// process group: the chief hosts the rendezvous store at its TF_CONFIG address, or a process
// outside the workers does (FLOTILLA_RENDEZVOUS; flotilla's own store, with authentication,
// bounded reads and a heartbeat; see flotilla/rendezvous/config.h). CPU tensors travel over
// Gloo's TCP ring, CUDA tensors over NCCL when LibTorch has CUDA. Every
// operation is asynchronous and returns a Work; Work::wait() rethrows a failure as CommError, or
// TimeoutError once CommunicationOptions::timeout has passed: a collective never hangs forever.
//
// As with every collective library, all ranks must issue the same operations in the same order,
// each from one thread at a time. Every operation carries a sequence number; when one times out,
// the ranks that reached it compare notes through the rendezvous store, so the error names the
// ranks that did not arrive and, where they said, the operation they were in instead.
#pragma once

#include <ATen/core/Tensor.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "flotilla/cluster/cluster_spec.h"

namespace flotilla::collective {

enum class ReduceOp { kSum, kMean, kMax, kMin };

// TensorFlow's CommunicationImplementation.
enum class Implementation {
  kAuto, // NCCL for CUDA tensors when built with it, the Gloo ring otherwise
  kRing, // Gloo's TCP ring for every tensor
  kNccl, // NCCL; CPU tensors still use the ring (NCCL cannot reduce them)
};
std::string_view to_string(Implementation implementation);
std::string_view to_string(ReduceOp op);
// "auto", "ring" or "nccl", any case; ConfigError otherwise.
Implementation parse_implementation(std::string_view name);

// How gradients travel between workers: cast for the wire, reduced, restored to their dtype.
enum class Compression { kNone, kFp16, kBf16 };
std::string_view to_string(Compression compression);
// "none", "fp16" or "bf16", any case; ConfigError otherwise.
Compression parse_compression(std::string_view name);

// TensorFlow's CommunicationOptions, plus the gradient engine's settings (PyTorch DDP's
// bucket_cap_mb and overlap, Horovod's compression).
struct CommunicationOptions {
  Implementation implementation = Implementation::kAuto;
  // Longest wait for the rendezvous and for any one collective before TimeoutError.
  std::chrono::milliseconds timeout = std::chrono::minutes(5);
  // Gradients are packed into flat buffers of at most this many bytes (TF's bytes_per_pack).
  std::int64_t bytes_per_pack = 25 * 1024 * 1024;
  // Start each bucket's all-reduce during backward, as soon as its last gradient is ready;
  // false: all of them after backward.
  bool overlap = true;
  // Gradients cross workers in half precision (half the bytes); the local math stays fp32.
  Compression compression = Compression::kNone;
  // When every rank of a group runs on this host (the same boot, and network, IPC, mount and
  // PID namespaces), CPU tensors' all-reduces go through a shared-memory segment on the calling
  // thread instead of Gloo's TCP ring over loopback: each rank copies its tensor in, sums its
  // share, copies the result out (the same bits on every rank; with three or more ranks the sums
  // may round differently from the ring's). A peer that exits, or whose heartbeat stops, fails
  // the wait as a closed connection would. Other collectives, groups across hosts, and a host
  // whose /dev/shm cannot hold the segment (4 MiB per rank and one more) use the ring.
  bool shared_memory = true;
  // The shared secret a process must prove it holds (HMAC-SHA256 challenge-response) before the
  // chief lets it join; nullopt: none is asked for. Set it on every task or on none. Resolve it
  // with cluster::cluster_token(); it is never logged.
  std::optional<std::string> cluster_token;
  // The key of what this group saves (a checkpoint's manifest.hmac, see CheckpointManager) and
  // checks when it resumes: a secret that outlives the run, normally the cluster token the
  // user set. nullopt: saved and read unkeyed. The CLI leaves it unset for a token `flotilla
  // launch` made for one run (the next run's differs and could not read the backups).
  std::optional<std::string> checkpoint_key;
  // Without a cluster token, a job whose rendezvous or tasks are on other hosts than this one's
  // loopback is refused (ConfigError): anyone who can reach the rendezvous could join it, read
  // and write its store. true: run it unauthenticated anyway (a warning says so at the start).
  bool insecure = false;
  // Every rank pings the chief this often; a rank silent for heartbeat_timeout (stopped, hung,
  // cut off) or whose connection closes (it died) fails the group on every other rank within
  // about that time, inside a collective or between them.
  std::chrono::milliseconds heartbeat_interval = std::chrono::seconds(1);
  std::chrono::milliseconds heartbeat_timeout = std::chrono::seconds(10);
  // (A fixed group is joined with Communicator::connect, an elastic one with
  // ElasticGroup::join; a strategy chooses with strategy::ElasticOptions.)
};

// Whether this build has the NCCL backend (LibTorch with CUDA).
bool nccl_available();

// The replicas of one worker: one tensor per replica, the same shape and dtype, each on its
// replica's device. reduce_to_first() sums them into tensors[0]; broadcast_from_first() copies
// tensors[0] into the others. CUDA tensors on distinct devices go through NCCL in one group call
// (LibTorch's communicators for that device set) on each device's current stream, so they are
// ordered after the kernels that produced them with no host synchronisation; otherwise plain
// adds and copies (across devices when they differ).
void reduce_to_first(const std::vector<at::Tensor>& tensors);
void broadcast_from_first(const std::vector<at::Tensor>& tensors);
// "nccl" or "copy": how the two above move these tensors.
std::string local_transport(const std::vector<at::Tensor>& tensors);

// The handle to one asynchronous collective. Copies share the same operation.
class Work {
 public:
  Work() = default; // an already completed, empty operation

  // Blocks until the operation completes. Rethrows its failure (CommError/TimeoutError naming
  // the operation, its sequence number and this rank); later calls rethrow the same failure.
  void wait();
  // True once the result is final (a completed mean is divided, a strided tensor written back);
  // it never blocks, and a failure is rethrown by the next wait(). Call wait() before reading a
  // result: the backends have finished, but the last step runs in wait() or here.
  bool is_completed();
  // all_gather's result after wait(): one tensor per rank, in rank order.
  const std::vector<at::Tensor>& result() const;
  // When the backend finished the operation (for overlap statistics); unset before that, or
  // for an operation that had nothing to send.
  std::optional<std::chrono::steady_clock::time_point> completed_at() const;

  struct State;

 private:
  explicit Work(std::shared_ptr<State> state) : state_(std::move(state)) {}
  void finish_locked(bool diagnose);
  void wait_for_backend();
  std::shared_ptr<State> state_;
  friend class Communicator;
};

class Communicator;
namespace detail {
void sever_group(Communicator& group); // src/collective/group.h: an elastic generation's end
} // namespace detail

class Communicator {
 public:
  // Joins the training group `spec` describes: rank 0 hosts the rendezvous store at
  // spec.rendezvous (bound to that address only) unless spec.external_rendezvous says a
  // process outside the workers does (flotilla rendezvous), the others connect to it, prove they
  // hold options.cluster_token when one is set, and claim their rank (ConfigError when refused).
  // Blocks until every rank has joined or options.timeout passes (TimeoutError naming the
  // ranks that did not join). Then each rank's heartbeat watches the others (see
  // CommunicationOptions::heartbeat_timeout): once a peer has failed, every operation fails
  // with a CommError naming it.
  static Communicator connect(const cluster::ClusterSpec& spec,
                              const CommunicationOptions& options = {});
  // A group of `world_size` ranks inside this process over an in-memory store (one thread per
  // rank issues the collectives). For tests and for several replicas per worker.
  static std::vector<Communicator> local_group(int world_size,
                                               const CommunicationOptions& options = {});

  int rank() const;
  int size() const;
  const CommunicationOptions& options() const;

  // In place on `tensor`; every rank passes a tensor of the same shape and dtype.
  Work all_reduce(const at::Tensor& tensor, ReduceOp op = ReduceOp::kSum);
  // Overwrites `tensor` on every rank with root's.
  Work broadcast(const at::Tensor& tensor, int root = 0);
  // Every rank's `tensor`, in rank order, in Work::result().
  Work all_gather(const at::Tensor& tensor);
  Work barrier();

  // The backend that carries `tensor`'s collectives: "gloo" or "nccl" (made on first use), or
  // "shared memory" for its all-reduces (CommunicationOptions::shared_memory).
  std::string transport(const at::Tensor& tensor);
  // Seconds this rank's shared-memory all-reduces (run on the calling thread, in backward's
  // hooks) have spent waiting for the other ranks so far; 0 without shared memory, where the
  // backends wait on their own threads.
  double shared_memory_waited_seconds() const;

  // Impl is private to the library: its own factories (connect, local_group, an elastic
  // generation's make_group in src/collective/group.h) make one.
  struct Impl;
  explicit Communicator(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}

 private:
  std::shared_ptr<Impl> impl_;
  friend void detail::sever_group(Communicator& group);
};

} // namespace flotilla::collective
