#include "flotilla/collective/communicator.h"

#include <arpa/inet.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <condition_variable>
#include <cstdlib>
#include <functional>
#include <mutex>
#include <thread>

#include "collective/backend_failure.h"
#include "collective/backends.h"
#include "collective/group.h"
#include "collective/shared_memory.h"
#include "flotilla/error.h"
#include "flotilla/log.h"
#include "flotilla/rendezvous/agent_store.h"
#include "flotilla/rendezvous/config.h"
#include "flotilla/rendezvous/heartbeat.h"
#include "flotilla/rendezvous/reports.h"
#include "flotilla/rendezvous/server.h"
#include "flotilla/rendezvous/store.h"

namespace flotilla::collective {

std::string_view to_string(Implementation implementation) {
  switch (implementation) {
  case Implementation::kAuto:
    return "AUTO";
  case Implementation::kRing:
    return "RING";
  case Implementation::kNccl:
    return "NCCL";
  }
  return "?";
}

std::string_view to_string(ReduceOp op) {
  switch (op) {
  case ReduceOp::kSum:
    return "sum";
  case ReduceOp::kMean:
    return "mean";
  case ReduceOp::kMax:
    return "max";
  case ReduceOp::kMin:
    return "min";
  }
  return "?";
}

std::string_view to_string(Compression compression) {
  switch (compression) {
  case Compression::kNone:
    return "none";
  case Compression::kFp16:
    return "fp16";
  case Compression::kBf16:
    return "bf16";
  }
  return "?";
}

namespace {
std::string lowercase(std::string_view name) {
  std::string lower;
  for (char c : name) lower += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return lower;
}
} // namespace

Compression parse_compression(std::string_view name) {
  const std::string lower = lowercase(name);
  if (lower == "none") return Compression::kNone;
  if (lower == "fp16") return Compression::kFp16;
  if (lower == "bf16") return Compression::kBf16;
  throw ConfigError("gradient compression \"" + std::string(name) +
                    "\" is unknown; use none, fp16 or bf16");
}

Implementation parse_implementation(std::string_view name) {
  const std::string lower = lowercase(name);
  if (lower == "auto") return Implementation::kAuto;
  if (lower == "ring") return Implementation::kRing;
  if (lower == "nccl") return Implementation::kNccl;
  throw ConfigError("communication implementation \"" + std::string(name) +
                    "\" is unknown; use AUTO, RING or NCCL");
}

bool nccl_available() {
  return detail::nccl_built();
}

void reduce_to_first(const std::vector<at::Tensor>& tensors) {
  if (tensors.size() < 2 || detail::nccl_local_reduce(tensors)) return;
  at::Tensor first = tensors.front();
  for (std::size_t r = 1; r < tensors.size(); ++r) {
    // Same device: a plain add. Across devices the copy is ordered after both devices' current
    // streams (LibTorch's cross-device copy), so nothing waits on the host.
    first.add_(tensors[r].device() == first.device()
                   ? tensors[r]
                   : tensors[r].to(first.device(), /*non_blocking=*/true));
  }
}

void broadcast_from_first(const std::vector<at::Tensor>& tensors) {
  if (tensors.size() < 2 || detail::nccl_local_broadcast(tensors)) return;
  for (std::size_t r = 1; r < tensors.size(); ++r) {
    at::Tensor target = tensors[r];
    target.copy_(tensors.front(), /*non_blocking=*/true);
  }
}

std::string local_transport(const std::vector<at::Tensor>& tensors) {
  return detail::nccl_local_usable(tensors) ? "nccl" : "copy";
}

namespace {

using detail::backend_message;
using detail::FailureKind;

// Once a peer has failed the group cannot recover in place: every operation says what to do.
constexpr const char* kRestartAdvice =
    "; restart the workers (a launcher such as flotilla launch, or the job's scheduler, can "
    "restart them); BackupAndRestore resumes from the last backup";

std::string seconds(std::chrono::milliseconds d) {
  const auto ms = d.count();
  return ms % 1000 == 0 ? std::to_string(ms / 1000) + "s" : std::to_string(ms) + "ms";
}

// "float", "long", "bfloat16": c10's names, lower-cased.
std::string dtype_name(const at::Tensor& t) {
  std::string name = c10::toString(t.scalar_type());
  for (auto& c : name) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return name;
}

std::vector<std::uint8_t> bytes(const std::string& s) {
  return {s.begin(), s.end()};
}

using Names = std::shared_ptr<const std::vector<std::string>>;

std::string join_ranks(const std::vector<int>& ranks, const Names& names) {
  std::string out;
  const bool named = names && !names->empty();
  for (std::size_t i = 0; i < ranks.size(); ++i) {
    out += (i == 0                  ? ""
            : i + 1 == ranks.size() ? " and "
                                    : ", ") +
           (named ? names->at(static_cast<std::size_t>(ranks[i])) : std::to_string(ranks[i]));
  }
  return named ? out : (ranks.size() == 1 ? "rank " : "ranks ") + out;
}

// After `description` (#sequence) timed out on `rank`: says where this rank is through the
// store, waits up to `grace` for the others to say where they are (ranks stuck in the same
// operation time out too and answer), and names those that did not arrive.
std::string missing_ranks(c10d::Store& store, int rank, int size, std::uint64_t sequence,
                          const std::string& description, std::chrono::milliseconds grace,
                          const Names& names) {
  const std::string prefix = "flotilla/at/";
  std::vector<int> silent;
  std::vector<std::pair<int, std::string>> elsewhere;
  try {
    // The group has failed anyway: the store may stop waiting after `grace` from here on, so an
    // unreachable chief cannot delay the error by the full timeout per question.
    store.setTimeout(grace);
    store.set(prefix + std::to_string(rank), bytes(std::to_string(sequence) + " " + description));
    const auto deadline = std::chrono::steady_clock::now() + grace;
    while (true) {
      silent.clear();
      elsewhere.clear();
      for (int r = 0; r < size; ++r) {
        if (r == rank) continue;
        if (std::chrono::steady_clock::now() >= deadline + grace) {
          silent.push_back(r); // the store answers too slowly to ask: no word from it either
          continue;
        }
        const std::string key = prefix + std::to_string(r);
        if (!store.check({key})) {
          silent.push_back(r);
          continue;
        }
        const auto value = store.get(key);
        const std::string said(value.begin(), value.end());
        const auto space = said.find(' ');
        if (said.substr(0, space) != std::to_string(sequence)) {
          elsewhere.emplace_back(r, space == std::string::npos ? said : said.substr(space + 1));
        }
      }
      if ((silent.empty() && elsewhere.empty()) || std::chrono::steady_clock::now() >= deadline) {
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    if (!silent.empty()) {
      // An elastic rendezvous expels the members this one waited for in vain (see
      // Membership::reported_silent); a fixed group's keeps the report as a plain key.
      store.set(detail::kSilentPrefix + std::to_string(rank),
                bytes(detail::SilentReport{sequence, silent, description}.text()));
    }
  } catch (const std::exception& e) {
    return "; the other ranks could not be asked where they are (rendezvous store: " +
           backend_message(e) + "; is the chief down?)";
  }
  if (silent.empty() && elsewhere.empty()) {
    return "; every rank reached this operation, so the network between them is the suspect";
  }
  std::string out;
  if (!silent.empty()) {
    out += "; " + join_ranks(silent, names) + " did not arrive (no word from " +
           (silent.size() == 1 ? "it" : "them") +
           ": stopped, dead, or busy outside the collectives)";
  }
  for (const auto& [r, where] : elsewhere) {
    out += "; " + join_ranks({r}, names) + " did not arrive: it is in " + where + " instead";
  }
  return out;
}

} // namespace

// What the heartbeat learned: the first failure of a peer, shared by the group's operations.
// Every completed operation notifies `cv`, so a waiter wakes for whichever comes first.
struct Health {
  std::mutex mutex;
  std::condition_variable cv;
  std::string failure;                   // empty: healthy; written once, under the mutex
  bool changed = false;                  // elastic: the membership moved on (GroupChanged)
  std::atomic<bool> failed{false};       // set after `failure`: every operation reads it, lock-free
  std::atomic<std::uint64_t> reached{0}; // the newest operation's sequence number (started)

  std::string failure_text() {
    std::lock_guard<std::mutex> lock(mutex);
    return failure;
  }
};

namespace detail {

[[noreturn]] void throw_failed(Health& health, const std::string& head) {
  std::string failure;
  bool changed = false;
  {
    std::lock_guard<std::mutex> lock(health.mutex);
    failure = health.failure;
    changed = health.changed;
  }
  if (changed) {
    throw GroupChanged(
        head + failure +
        "; the group goes on without it in a new generation (ElasticGroup::regroup)");
  }
  throw CommError(head + failure + kRestartAdvice);
}

std::shared_ptr<Health> new_health() {
  return std::make_shared<Health>();
}

std::shared_ptr<const std::atomic<std::uint64_t>>
reached_of(const std::shared_ptr<Health>& health) {
  return {health, &health->reached};
}

bool fail_group(Health& health, const std::string& why, bool changed) {
  {
    std::lock_guard<std::mutex> lock(health.mutex);
    if (!health.failure.empty()) return false;
    health.failure = why;
    health.changed = changed;
    health.failed = true;
  }
  health.cv.notify_all();
  return true;
}

bool group_failed(const Health& health) {
  return health.failed;
}

} // namespace detail

struct Work::State {
  c10::intrusive_ptr<c10d::Work> work; // null: nothing to wait for
  std::shared_ptr<Health> health;      // null: no heartbeat (a group inside one process)
  std::shared_ptr<const std::vector<std::string>> names; // how to name the ranks in errors
  std::function<void()> finish; // after success: mean's division, copy-back
  std::string description;      // "all_reduce #7 (sum, 1024 x float)"
  std::chrono::milliseconds timeout{0};
  std::vector<std::vector<at::Tensor>> gathered; // all_gather's output lists
  // For the timeout diagnosis (who did not arrive): the group's store, this rank's place and
  // the operation's sequence number; no store in a group of one.
  c10::intrusive_ptr<c10d::Store> store;
  int rank = 0;
  int size = 1;
  std::uint64_t sequence = 0;
  std::string where() const {
    return "rank " + std::to_string(rank) + " of " + std::to_string(size);
  }
  // NCCL on CUDA tensors: wait() orders the caller's current stream after the collective and
  // returns; the host never blocks on it (the backend's future completes at launch, so it tells
  // no completion time either).
  bool stream_ordered = false;
  std::atomic<std::int64_t> completed_ns{-1}; // steady_clock, set by the backend's future
  std::mutex mutex;
  bool done = false;
  std::exception_ptr error;
};

void Work::wait() {
  if (!state_) return;
  std::lock_guard<std::mutex> lock(state_->mutex);
  finish_locked(/*diagnose=*/true);
}

void Work::finish_locked(bool diagnose) {
  if (!state_->done) {
    try {
      if (state_->work) wait_for_backend();
      if (state_->finish) state_->finish();
    } catch (const Error&) {
      state_->error = std::current_exception();
    } catch (const std::exception& e) {
      const std::string message = backend_message(e);
      const std::string head = state_->description + " on " + state_->where();
      const FailureKind kind = detail::classify_failure(e);
      if (kind == FailureKind::kTimeout) {
        // Asking the other ranks takes up to a few seconds: wait() does, is_completed() not.
        const std::string missing =
            diagnose && state_->store ? missing_ranks(*state_->store, state_->rank, state_->size,
                                                      state_->sequence, state_->description,
                                                      std::min<std::chrono::milliseconds>(
                                                          state_->timeout, std::chrono::seconds(5)),
                                                      state_->names)
                                      : "";
        state_->error = std::make_exception_ptr(
            TimeoutError(head + " did not complete within " + seconds(state_->timeout) + " (" +
                         message + ")" + missing +
                         "; check the other workers' output, or raise "
                         "CommunicationOptions::timeout"));
      } else {
        state_->error = std::make_exception_ptr(CommError(
            head + " failed (" + message + ")" +
            (kind == FailureKind::kConnectionLoss
                 ? "; a peer probably exited or lost its network: check the other workers' output"
                 : "")));
      }
    }
    state_->done = true;
  }
  if (state_->error) std::rethrow_exception(state_->error);
}

void Work::wait_for_backend() {
  // Gloo and NCCL enforce the timeout themselves; the margin only guards a backend that would
  // not.
  const auto limit = state_->timeout + std::chrono::seconds(5);
  if (state_->stream_ordered) {
    // A peer that dies mid-collective is NCCL's watchdog's to find (it aborts the communicator
    // after the timeout); the heartbeat's news still stops every operation at its start and
    // here. No timeout: with one, WorkNCCL::wait polls the event from the host (a block per
    // bucket, and illegal inside a CUDA-graph capture); without, it only orders the streams.
    if (state_->health && state_->health->failed) {
      detail::throw_failed(*state_->health,
                           state_->description + " on " + state_->where() + " cannot complete: ");
    }
    state_->work->wait();
    return;
  }
  if (auto health = state_->health) {
    // Wait for the operation or for the heartbeat's news of a dead peer, whichever comes
    // first: the backend alone would wait out its whole timeout for a peer that is stopped.
    const auto deadline = std::chrono::steady_clock::now() + limit;
    std::unique_lock<std::mutex> lock(health->mutex);
    // The backend's future runs our callback (which sets completed_ns) a moment before the
    // work itself says isCompleted(): either is enough to stop waiting here.
    const auto finished = [&] {
      return state_->completed_ns.load() >= 0 || state_->work->isCompleted();
    };
    while (!finished() && std::chrono::steady_clock::now() < deadline) {
      if (!health->failure.empty()) {
        lock.unlock();
        detail::throw_failed(*health,
                             state_->description + " on " + state_->where() + " cannot complete: ");
      }
      health->cv.wait_for(lock, std::chrono::milliseconds(200));
    }
  }
  state_->work->wait(limit);
}

bool Work::is_completed() {
  if (!state_) return true;
  // Never blocks: a thread inside wait() holds the lock, and then it is not completed yet.
  std::unique_lock<std::mutex> lock(state_->mutex, std::try_to_lock);
  if (!lock.owns_lock()) return false;
  if (!state_->done && (!state_->work || state_->work->isCompleted())) {
    finish_locked(/*diagnose=*/false); // the result is final only after `finish` runs
  }
  return state_->done;
}

std::optional<std::chrono::steady_clock::time_point> Work::completed_at() const {
  if (!state_) return std::nullopt;
  const std::int64_t ns = state_->completed_ns.load();
  if (ns < 0) return std::nullopt;
  return std::chrono::steady_clock::time_point(std::chrono::nanoseconds(ns));
}

const std::vector<at::Tensor>& Work::result() const {
  static const std::vector<at::Tensor> kNone;
  if (!state_ || state_->gathered.empty()) return kNone;
  return state_->gathered.front();
}

struct Communicator::Impl {
  int rank = 0;
  int size = 1;
  CommunicationOptions options;
  std::unique_ptr<detail::RendezvousServer> server; // the chief's
  std::shared_ptr<Health> health;                   // null inside one process
  std::unique_ptr<detail::Heartbeat> heartbeat;
  // "worker 1 at host:port (rank 2)" per rank; null inside one process.
  std::shared_ptr<const std::vector<std::string>> names;
  c10::intrusive_ptr<c10d::Store> store;
  c10::intrusive_ptr<c10d::Backend> ring;
  c10::intrusive_ptr<c10d::Backend> nccl; // made on the first CUDA collective
  // CommunicationOptions::shared_memory, when every rank is on this host: CPU all-reduces.
  std::unique_ptr<detail::SharedMemoryReduce> shared_memory;
  std::uint64_t sequence = 0;
  bool warned_nccl_cpu = false;

  ~Impl() {
    heartbeat.reset(); // a goodbye: leaving is not failing
    if (health && health->failed) {
      // A failed group is not waited for here: its backend's threads may be blocked on a peer
      // that will never answer until the backend's timeout. The Gloo ring is destroyed on a
      // thread of its own instead (its destructor waits for them, then closes its sockets,
      // which ends the peers' blocked operations on it too); kept for good, an elastic
      // worker's threads and sockets grew by the whole backend (3 threads, 5 files in a group
      // of 4) with every fault it lived through. NCCL's communicator is still left as it is:
      // destroying one with a hung peer can block forever.
      if (ring) std::thread([dead = std::move(ring)]() mutable { dead.reset(); }).detach();
      (void)nccl.release();
    }
    ring.reset();
    nccl.reset();
    store.reset();
    server.reset();
  }

  c10d::Backend& backend_for(const at::Tensor& tensor) {
    const bool cuda = tensor.defined() && tensor.is_cuda();
    if (options.implementation == Implementation::kNccl && !cuda && !warned_nccl_cpu) {
      warned_nccl_cpu = true;
      Logger(rank, size)
          .warn("implementation NCCL was asked for, but NCCL reduces CUDA tensors "
                "only; CPU tensors use the Gloo ring");
    }
    if (!cuda || options.implementation == Implementation::kRing || !detail::nccl_built()) {
      return *ring;
    }
    if (!nccl) {
      nccl = detail::make_nccl_backend(c10::make_intrusive<c10d::PrefixStore>("nccl", store), rank,
                                       size, options.timeout);
    }
    return *nccl;
  }

  std::shared_ptr<Work::State> begin(const std::string& op, const at::Tensor* tensor,
                                     const std::string& detail = "") {
    auto state = std::make_shared<Work::State>();
    std::string shape;
    if (tensor) {
      shape = std::to_string(tensor->numel()) + " x " + dtype_name(*tensor);
    }
    std::string inside = detail;
    if (!shape.empty()) inside += (inside.empty() ? "" : ", ") + shape;
    state->description =
        op + " #" + std::to_string(++sequence) + (inside.empty() ? "" : " (" + inside + ")");
    state->timeout = options.timeout;
    state->rank = rank;
    state->size = size;
    state->sequence = sequence;
    if (health) health->reached.store(sequence, std::memory_order_relaxed);
    if (size > 1) state->store = store;
    state->health = health;
    state->names = names;
    if (health && health->failed) {
      detail::throw_failed(*health,
                           state->description + " on " + state->where() + " cannot start: ");
    }
    return state;
  }

  // Runs `launch` and wraps a synchronous failure the same way wait() would.
  Work start(std::shared_ptr<Work::State> state,
             const std::function<c10::intrusive_ptr<c10d::Work>()>& launch) {
    try {
      state->work = launch();
      if (state->stream_ordered) return Work(std::move(state));
      // The backend marks the future done as it finishes; the time tells how much of a
      // collective ran hidden behind other work. (A weak reference: the future must not keep
      // the state, which keeps the work, which keeps the future, alive.)
      std::weak_ptr<Work::State> weak = state;
      std::weak_ptr<Health> weak_health = health;
      try {
        state->work->getFuture()->addCallback([weak, weak_health](c10::ivalue::Future&) {
          if (auto s = weak.lock()) {
            s->completed_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
                                  std::chrono::steady_clock::now().time_since_epoch())
                                  .count();
          }
          if (auto h = weak_health.lock()) {
            { std::lock_guard<std::mutex> lock(h->mutex); } // no wakeup lost in between
            h->cv.notify_all();
          }
        });
      } catch (const std::exception&) {
        // A backend without futures: no completion time, nothing else lost.
      }
    } catch (const Error&) {
      throw;
    } catch (const std::exception& e) {
      state->error =
          std::make_exception_ptr(CommError(state->description + " on " + state->where() +
                                            " could not start (" + backend_message(e) + ")"));
      state->done = true;
    }
    return Work(std::move(state));
  }
};

namespace {

// c10d's flight recorder (a process-wide log of every collective, for PyTorch's Python
// debugging tools) updates a map outside its lock in LibTorch 2.11, so two process groups in
// one process (ranks as threads, replicas per worker) crash it now and then; it also captures a
// traceback per collective. flotilla names failed collectives itself, so it is switched off,
// unless a user set TORCH_FR_BUFFER_SIZE. It is read once, when the first group is made.
void disable_flight_recorder() {
  static std::once_flag once;
  std::call_once(once, [] { ::setenv("TORCH_FR_BUFFER_SIZE", "0", /*overwrite=*/0); });
}

std::shared_ptr<Communicator::Impl> make_impl(int rank, int size,
                                              const CommunicationOptions& options,
                                              c10::intrusive_ptr<c10d::Store> store,
                                              const std::string& local_host) {
  if (options.implementation == Implementation::kNccl && !detail::nccl_built()) {
    throw ConfigError(
        "implementation NCCL was asked for, but this build has no NCCL backend (LibTorch without "
        "CUDA); use AUTO or RING");
  }
  disable_flight_recorder();
  auto impl = std::make_shared<Communicator::Impl>();
  impl->rank = rank;
  impl->size = size;
  impl->options = options;
  impl->store = store;
  impl->ring = detail::make_gloo_backend(c10::make_intrusive<c10d::PrefixStore>("gloo", store),
                                         rank, size, local_host, options.timeout);
  if (options.shared_memory && size > 1) {
    std::string why;
    c10d::PrefixStore shm_store("shm", store);
    impl->shared_memory = detail::SharedMemoryReduce::open(shm_store, rank, size, why);
    if (!impl->shared_memory && rank == 0) {
      Logger(rank, size)
          .warn("shared memory was asked for, but " + why + "; CPU tensors use the Gloo ring");
    }
  }
  return impl;
}

} // namespace

detail::RendezvousConfig detail::rendezvous_config(const cluster::ClusterSpec& spec,
                                                   const CommunicationOptions& options) {
  RendezvousOptions o;
  o.cluster_token = options.cluster_token;
  o.insecure = options.insecure;
  o.timeout = options.timeout;
  o.heartbeat_interval = options.heartbeat_interval;
  o.heartbeat_timeout = options.heartbeat_timeout;
  return rendezvous_config(spec, o);
}

Communicator Communicator::connect(const cluster::ClusterSpec& spec,
                                   const CommunicationOptions& options) {
  if (spec.is_evaluator()) {
    throw ConfigError(
        "this task is the evaluator, which is not part of the training group; only chief and "
        "worker tasks join the collectives");
  }
  if (spec.world_size == 1) return local_group(1, options).front();

  const std::string where =
      "rank " + std::to_string(spec.rank) + " of " + std::to_string(spec.world_size);
  detail::RendezvousConfig rendezvous = detail::rendezvous_config(spec, options);
  std::unique_ptr<detail::RendezvousServer> server;
  if (!spec.agent_store_key.empty()) {
    detail::meet_through_agent_store(spec, options.timeout, rendezvous, server);
  } else if (spec.rank == 0 && !spec.external_rendezvous) {
    server = std::make_unique<detail::RendezvousServer>(rendezvous);
  }
  auto rendezvous_store = c10::make_intrusive<detail::RendezvousStore>(rendezvous);
  rendezvous_store->wait_for_all_ranks();
  c10::intrusive_ptr<c10d::Store> store = rendezvous_store;
  try {
    auto impl = make_impl(spec.rank, spec.world_size, options, store, spec.local_host);
    impl->server = std::move(server);
    impl->health = std::make_shared<Health>();
    impl->names = std::make_shared<const std::vector<std::string>>(rendezvous.names);
    const Logger log(spec.rank, spec.world_size);
    impl->heartbeat = std::make_unique<detail::Heartbeat>(
        rendezvous, [health = std::weak_ptr<Health>(impl->health), log](const std::string& why) {
          auto h = health.lock();
          if (!h || !detail::fail_group(*h, why, /*changed=*/false)) return;
          log.error(why + "; the training group cannot continue: its collectives fail from now");
        });
    return Communicator(std::move(impl));
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    const std::string message = backend_message(e);
    const std::string head = "connecting the collectives of " + where + " (bound to " +
                             (spec.local_host.empty() ? "this host's name" : spec.local_host) +
                             ") ";
    if (detail::classify_failure(e) == FailureKind::kTimeout) {
      throw TimeoutError(head + "did not complete within " + seconds(options.timeout) + " (" +
                         message + "); a worker is missing or unreachable");
    }
    throw CommError(head + "failed: " + message);
  }
}

bool detail::wait_until_failed(Health& health, std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(health.mutex);
  return health.cv.wait_for(lock, timeout, [&] { return health.failed.load(); });
}

void detail::sever_group(Communicator& group) {
  if (group.impl_ && group.impl_->ring) close_gloo_connections(*group.impl_->ring);
}

Communicator detail::make_group(int rank, int size, const CommunicationOptions& options,
                                c10::intrusive_ptr<c10d::Store> store,
                                const std::string& local_host, std::vector<std::string> names,
                                std::shared_ptr<Health> health) {
  auto impl = make_impl(rank, size, options, std::move(store), local_host);
  impl->health = std::move(health);
  impl->names = std::make_shared<const std::vector<std::string>>(std::move(names));
  return Communicator(std::move(impl));
}

std::vector<Communicator> Communicator::local_group(int world_size,
                                                    const CommunicationOptions& options) {
  if (world_size < 1) {
    throw ConfigError("a group needs at least one rank; saw world_size " +
                      std::to_string(world_size));
  }
  c10::intrusive_ptr<c10d::Store> store = c10::make_intrusive<c10d::HashStore>();
  std::vector<std::shared_ptr<Impl>> impls(world_size);
  std::vector<std::exception_ptr> errors(world_size);
  {
    // Every rank's constructor waits for the others, so they must run at once.
    std::vector<std::thread> threads;
    for (int r = 0; r < world_size; ++r) {
      threads.emplace_back([&, r] {
        try {
          impls[r] = make_impl(r, world_size, options, store, "127.0.0.1");
        } catch (...) {
          errors[r] = std::current_exception();
        }
      });
    }
    for (auto& t : threads) t.join();
  }
  for (auto& e : errors) {
    if (e) std::rethrow_exception(e);
  }
  std::vector<Communicator> out;
  for (auto& impl : impls) out.push_back(Communicator(impl));
  return out;
}

int Communicator::rank() const {
  return impl_->rank;
}
int Communicator::size() const {
  return impl_->size;
}
const CommunicationOptions& Communicator::options() const {
  return impl_->options;
}

Work Communicator::all_reduce(const at::Tensor& tensor, ReduceOp op) {
  auto state = impl_->begin("all_reduce", &tensor, std::string(to_string(op)));
  if (op == ReduceOp::kMean && !at::isFloatingType(tensor.scalar_type())) {
    throw ConfigError(state->description + ": a mean of integer values would be truncated; use "
                                           "ReduceOp::kSum and divide in floating point");
  }
  if (tensor.numel() == 0) return Work(std::move(state));
  // The backends need contiguous memory; a strided view is reduced in a copy and written back.
  at::Tensor buffer = tensor.contiguous();
  const bool copy_back = !buffer.is_same(tensor);
  const int size = impl_->size;
  if (op == ReduceOp::kMean || copy_back) {
    state->finish = [buffer, tensor, op, size, copy_back] {
      if (op == ReduceOp::kMean) buffer.div_(size);
      if (copy_back) tensor.copy_(buffer);
    };
  }
  c10d::AllreduceOptions opts;
  opts.reduceOp = op == ReduceOp::kMax   ? c10d::ReduceOp::MAX
                  : op == ReduceOp::kMin ? c10d::ReduceOp::MIN
                                         : c10d::ReduceOp::SUM;
  if (impl_->shared_memory && detail::SharedMemoryReduce::takes(buffer)) {
    // On this thread, now (start() holds the state meanwhile); a failure is kept for wait() as a
    // backend's would be. While it waits for the others, the heartbeat's news of a failed peer
    // stops it.
    const Work::State* op = state.get();
    auto* shared = impl_->shared_memory.get();
    const auto timeout = impl_->options.timeout;
    return impl_->start(std::move(state), [&, op, health = impl_->health] {
      return shared->run(buffer, opts.reduceOp, timeout, [&health, op] {
        if (health && health->failed) {
          detail::throw_failed(*health,
                               op->description + " on " + op->where() + " cannot complete: ");
        }
      });
    });
  }
  auto& backend = impl_->backend_for(tensor);
  state->stream_ordered = tensor.is_cuda() && backend.getBackendName() == "nccl";
  return impl_->start(std::move(state), [&] {
    std::vector<at::Tensor> tensors{buffer};
    return backend.allreduce(tensors, opts);
  });
}

Work Communicator::broadcast(const at::Tensor& tensor, int root) {
  auto state = impl_->begin("broadcast", &tensor, "from rank " + std::to_string(root));
  if (root < 0 || root >= impl_->size) {
    throw ConfigError(state->description + ": root rank " + std::to_string(root) +
                      " is out of range; use 0 to " + std::to_string(impl_->size - 1));
  }
  if (tensor.numel() == 0) return Work(std::move(state));
  at::Tensor buffer = tensor.contiguous();
  if (!buffer.is_same(tensor)) state->finish = [buffer, tensor] { tensor.copy_(buffer); };
  c10d::BroadcastOptions opts;
  opts.rootRank = root;
  auto& backend = impl_->backend_for(tensor);
  state->stream_ordered = tensor.is_cuda() && backend.getBackendName() == "nccl";
  return impl_->start(std::move(state), [&] {
    std::vector<at::Tensor> tensors{buffer};
    return backend.broadcast(tensors, opts);
  });
}

Work Communicator::all_gather(const at::Tensor& tensor) {
  auto state = impl_->begin("all_gather", &tensor);
  at::Tensor buffer = tensor.contiguous();
  state->gathered.resize(1);
  for (int r = 0; r < impl_->size; ++r) state->gathered[0].push_back(at::empty_like(buffer));
  if (tensor.numel() == 0) return Work(std::move(state));
  auto& backend = impl_->backend_for(tensor);
  state->stream_ordered = tensor.is_cuda() && backend.getBackendName() == "nccl";
  auto* gathered = &state->gathered;
  return impl_->start(std::move(state), [&] {
    std::vector<at::Tensor> inputs{buffer};
    return backend.allgather(*gathered, inputs);
  });
}

double Communicator::shared_memory_waited_seconds() const {
  return impl_ && impl_->shared_memory ? impl_->shared_memory->waited_seconds() : 0.0;
}

std::string Communicator::transport(const at::Tensor& tensor) {
  if (impl_->shared_memory && detail::SharedMemoryReduce::takes(tensor.contiguous())) {
    return "shared memory"; // its all-reduces; the other collectives go through the ring
  }
  return impl_->backend_for(tensor).getBackendName();
}

Work Communicator::barrier() {
  auto state = impl_->begin("barrier", nullptr);
  auto& backend = *impl_->ring;
  return impl_->start(std::move(state), [&] { return backend.barrier(); });
}

} // namespace flotilla::collective
