#include "collective/shared_memory.h"

#include <ATen/ATen.h>
#include <ATen/core/ivalue.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <regex>
#include <stdexcept>
#include <thread>

#include <dirent.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "flotilla/base/hashes.h"

namespace flotilla::collective::detail {

namespace {

constexpr std::size_t kSlotBytes = std::size_t{4} << 20; // a chunk: each rank's and the result
constexpr std::size_t kLine = 64;

// One rank's progress: the number of the chunk it has reached a stage of. Each on its own line.
struct alignas(kLine) Flag {
  std::atomic<std::uint64_t> epoch;
};
static_assert(std::atomic<std::uint64_t>::is_always_lock_free,
              "a flag in shared memory must be lock-free to be shared between processes");
static_assert(sizeof(Flag) == kLine);

std::string text_of(const std::vector<std::uint8_t>& bytes) {
  return {bytes.begin(), bytes.end()};
}

std::string first_line(const char* path) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  return line;
}

std::string link_of(const char* path) {
  char buffer[256];
  const ssize_t n = ::readlink(path, buffer, sizeof buffer);
  return n > 0 ? std::string(buffer, static_cast<std::size_t>(n)) : "";
}

// What processes that can share a POSIX shared-memory segment and mean the same network have in
// common: this boot, and their network, IPC and mount namespaces. Hosts simulated with network
// namespaces on one machine are different hosts here.
std::string host_identity() {
  return first_line("/proc/sys/kernel/random/boot_id") + " " + link_of("/proc/self/ns/net") + " " +
         link_of("/proc/self/ns/ipc") + " " + link_of("/proc/self/ns/mnt") + " " +
         link_of("/proc/self/ns/pid");
}

// Whether process `pid` (of this PID namespace) still runs: not gone, not a zombie (0: none).
bool running(std::uint64_t pid) {
  if (pid == 0) return false;
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string stat;
  if (!std::getline(in, stat)) return false;
  const auto close = stat.rfind(") ");
  return close == std::string::npos || close + 2 >= stat.size() ||
         (stat[close + 2] != 'Z' && stat[close + 2] != 'X');
}

// This PID namespace's number ("pid:[4026531836]" -> "4026531836"): segment names carry it, so
// that a pid in a name is read only in the namespace it belongs to.
std::string pid_namespace() {
  const std::string link = link_of("/proc/self/ns/pid");
  std::string digits;
  for (char c : link) {
    if (c >= '0' && c <= '9') digits += c;
  }
  return digits;
}

// Segments whose maker was killed between making and unlinking them (rank 0 unlinks its
// segment as soon as every rank has mapped it, or open() failed): "flotilla-<ns>-<pid>-<16 hex>"
// in /dev/shm, of this user and this PID namespace, whose process no longer runs. Anything else
// there is left alone.
void remove_orphans(const std::string& ns) {
  DIR* dir = ::opendir("/dev/shm");
  if (!dir) return;
  const std::regex ours("flotilla-" + ns + "-([0-9]{1,9})-[0-9a-f]{16}");
  while (const dirent* entry = ::readdir(dir)) {
    const std::string name = entry->d_name;
    std::smatch match;
    if (!std::regex_match(name, match, ours)) continue;
    const std::uint64_t pid = std::stoull(match[1]);
    struct stat st {};
    if (::fstatat(::dirfd(dir), name.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0 ||
        !S_ISREG(st.st_mode) || st.st_uid != ::geteuid() || running(pid)) {
      continue;
    }
    ::shm_unlink(("/" + name).c_str());
  }
  ::closedir(dir);
}

std::string errno_text(const std::string& what) {
  return what + ": " + std::strerror(errno);
}

class SharedMemoryWork final : public c10d::Work {
 public:
  SharedMemoryWork(const at::Tensor& tensor, std::exception_ptr error)
      : future_(c10::make_intrusive<c10::ivalue::Future>(
            c10::ListType::create(c10::TensorType::get()))) {
    finish(error);
    if (error) {
      future_->setError(error);
    } else {
      future_->markCompleted(c10::IValue(std::vector<at::Tensor>{tensor}));
    }
  }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }

 private:
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

} // namespace

struct SharedMemoryReduce::Segment {
  int rank = 0;
  int size = 0;
  void* base = nullptr;
  std::size_t bytes = 0;
  std::uint64_t epoch = 0; // chunks reduced so far, the same on every rank
  bool broken = false;
  std::atomic<std::int64_t> waited_ns{0}; // in wait_for_all, for a peer

  static std::size_t bytes_for(int size) {
    return 3 * static_cast<std::size_t>(size) * kLine +
           (static_cast<std::size_t>(size) + 1) * kSlotBytes;
  }
  Flag* arrived() const { return static_cast<Flag*>(base); }
  Flag* reduced() const { return arrived() + size; }
  Flag* pids() const { return arrived() + 2 * size; } // each rank's process
  char* slot(int r) const {
    return static_cast<char*>(base) + 3 * static_cast<std::size_t>(size) * kLine +
           static_cast<std::size_t>(r) * kSlotBytes;
  }
  char* result() const { return slot(size); }

  ~Segment() {
    if (!base) return;
    // Gone: a rank still waiting for this one learns it at its next look.
    pids()[rank].epoch.store(0, std::memory_order_release);
    ::munmap(base, bytes);
  }

  // Until every rank's flag reached `epoch`: spinning a moment, then yielding, then sleeping
  // 50 us at a time, and asking `poll` all along once past the spin; every 100 ms whether the
  // processes waited for still run (a peer that exits is what a closed connection tells Gloo).
  void wait_for_all(Flag* flags, std::chrono::steady_clock::time_point deadline,
                    std::chrono::milliseconds timeout, const std::function<void()>& poll) {
    const auto start = std::chrono::steady_clock::now();
    auto next_look = start + std::chrono::milliseconds(100);
    for (long spins = 0;; ++spins) {
      int missing = -1;
      for (int r = 0; r < size && missing < 0; ++r) {
        if (flags[r].epoch.load(std::memory_order_acquire) < epoch) missing = r;
      }
      if (missing < 0) {
        if (spins > 0) {
          waited_ns.fetch_add(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                  std::chrono::steady_clock::now() - start)
                                  .count(),
                              std::memory_order_relaxed);
        }
        return;
      }
      if (spins < 200) continue;
      try {
        poll();
      } catch (...) {
        broken = true;
        throw;
      }
      const auto now = std::chrono::steady_clock::now();
      if (now >= next_look) {
        next_look = now + std::chrono::milliseconds(100);
        for (int r = 0; r < size; ++r) {
          const std::uint64_t pid = pids()[r].epoch.load(std::memory_order_acquire);
          if (flags[r].epoch.load(std::memory_order_acquire) < epoch && !running(pid)) {
            broken = true;
            throw std::runtime_error("Connection closed: rank " + std::to_string(r) +
                                     (pid == 0 ? " left the group (its communicator was destroyed)"
                                               : " (process " + std::to_string(pid) + ") exited") +
                                     " during the shared-memory all-reduce");
          }
        }
      }
      if (now >= deadline) {
        broken = true;
        std::string ranks;
        for (int r = 0; r < size; ++r) {
          if (flags[r].epoch.load(std::memory_order_acquire) < epoch) {
            ranks += (ranks.empty() ? "" : ", ") + std::to_string(r);
          }
        }
        throw std::runtime_error("Timed out waiting " + std::to_string(timeout.count()) +
                                 "ms in the shared-memory all-reduce for rank(s) " + ranks);
      }
      if (spins < 2000) {
        std::this_thread::yield();
      } else {
        std::this_thread::sleep_for(std::chrono::microseconds(50));
      }
    }
  }
};

SharedMemoryReduce::SharedMemoryReduce(std::unique_ptr<Segment> segment)
    : segment_(std::move(segment)) {}

SharedMemoryReduce::~SharedMemoryReduce() = default;

double SharedMemoryReduce::waited_seconds() const {
  return 1e-9 * static_cast<double>(segment_->waited_ns.load(std::memory_order_relaxed));
}

std::unique_ptr<SharedMemoryReduce> SharedMemoryReduce::open(c10d::Store& store, int rank, int size,
                                                             std::string& why) {
  const std::string me = host_identity();
  store.set("host/" + std::to_string(rank), me);
  for (int r = 0; r < size; ++r) {
    if (text_of(store.get("host/" + std::to_string(r))) != me) {
      why = "not every rank runs on this host";
      return nullptr;
    }
  }
  auto segment = std::make_unique<Segment>();
  segment->rank = rank;
  segment->size = size;
  const std::size_t bytes = Segment::bytes_for(size);
  std::string name, failure;
  int fd = -1;
  // Rank 0's name goes however open() ends: once every rank has tried (below), or when a wait
  // for another rank throws. The mappings stay until each process unmaps them.
  struct Cleanup {
    const std::string& name;
    const int& fd;
    bool unlink = false;
    ~Cleanup() {
      if (unlink) ::shm_unlink(name.c_str());
      if (fd >= 0) ::close(fd);
    }
  } cleanup{name, fd};
  if (rank == 0) {
    const std::string ns = pid_namespace();
    remove_orphans(ns);
    name = "/flotilla-" + ns + "-" + std::to_string(::getpid()) + "-" +
           base::to_hex(base::random_bytes<8>());
    fd = ::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    cleanup.unlink = fd >= 0;
    if (fd < 0) {
      failure = errno_text("shm_open " + name);
    } else if (const int e = ::posix_fallocate(fd, 0, static_cast<off_t>(bytes)); e != 0) {
      // tmpfs reserves the pages now or says ENOSPC; a sparse segment would SIGBUS later.
      errno = e;
      failure = errno_text("reserving " + std::to_string(bytes >> 20) + " MiB in /dev/shm");
    }
    store.set("name", failure.empty() ? name : "");
  } else {
    name = text_of(store.get("name"));
    if (name.empty()) {
      failure = "rank 0 could not make the segment";
    } else {
      fd = ::shm_open(name.c_str(), O_RDWR, 0);
      struct stat st {};
      if (fd < 0) {
        failure = errno_text("shm_open " + name);
      } else if (::fstat(fd, &st) != 0) {
        failure = errno_text("fstat " + name);
      } else if (st.st_uid != ::geteuid() || (st.st_mode & 07777) != 0600) {
        // Rank 0 makes it this user's, readable by nobody else: any other segment under that
        // name (another user's, or one others may write) is never mapped.
        char mode[8];
        std::snprintf(mode, sizeof mode, "%04o", static_cast<unsigned>(st.st_mode & 07777));
        failure = "the segment " + name + " is not rank 0's: it belongs to uid " +
                  std::to_string(st.st_uid) + " with mode " + mode +
                  ", where rank 0 makes it uid " + std::to_string(::geteuid()) +
                  "'s with mode 0600";
      } else if (static_cast<std::size_t>(st.st_size) != bytes) {
        failure = "the segment " + name + " is not the size rank 0 made";
      }
    }
  }
  if (failure.empty()) {
    void* base = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (base == MAP_FAILED) {
      failure = errno_text("mmap");
    } else {
      segment->base = base;
      segment->bytes = bytes;
    }
  }
  if (segment->base) segment->pids()[rank].epoch.store(static_cast<std::uint64_t>(::getpid()));
  store.set("ok/" + std::to_string(rank), failure.empty() ? "1" : failure);
  std::string first_failure;
  for (int r = 0; r < size; ++r) {
    const std::string ok = text_of(store.get("ok/" + std::to_string(r)));
    if (ok != "1" && first_failure.empty()) first_failure = "rank " + std::to_string(r) + ": " + ok;
  }
  if (!first_failure.empty()) {
    why = first_failure;
    return nullptr;
  }
  return std::unique_ptr<SharedMemoryReduce>(new SharedMemoryReduce(std::move(segment)));
}

bool SharedMemoryReduce::takes(const at::Tensor& tensor) {
  if (!tensor.defined() || !tensor.device().is_cpu() || !tensor.is_contiguous()) return false;
  switch (tensor.scalar_type()) {
  case at::kFloat:
  case at::kDouble:
  case at::kBFloat16:
  case at::kHalf:
  case at::kInt:
  case at::kLong:
    return true;
  default:
    return false;
  }
}

void SharedMemoryReduce::all_reduce(const at::Tensor& tensor, c10d::ReduceOp::RedOpType op,
                                    std::chrono::milliseconds timeout,
                                    const std::function<void()>& poll) {
  Segment& s = *segment_;
  if (s.broken) {
    throw std::runtime_error("an earlier shared-memory all-reduce of this group failed, so the "
                             "ranks no longer meet in step");
  }
  if (op != c10d::ReduceOp::SUM && op != c10d::ReduceOp::MAX && op != c10d::ReduceOp::MIN) {
    throw std::invalid_argument("the shared-memory all-reduce sums, or takes a maximum or minimum");
  }
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  const auto type = tensor.scalar_type();
  const std::size_t element = tensor.element_size();
  const std::int64_t chunk = static_cast<std::int64_t>(kSlotBytes / element);
  const std::int64_t n = tensor.numel();
  char* data = static_cast<char*>(tensor.data_ptr());
  const auto view = [&](char* p, std::int64_t count) {
    return at::from_blob(p, {count}, at::TensorOptions().dtype(type));
  };
  for (std::int64_t offset = 0; offset < n; offset += chunk) {
    const std::int64_t count = std::min(chunk, n - offset);
    const std::size_t bytes = static_cast<std::size_t>(count) * element;
    ++s.epoch;
    std::memcpy(s.slot(s.rank), data + static_cast<std::size_t>(offset) * element, bytes);
    s.arrived()[s.rank].epoch.store(s.epoch, std::memory_order_release);
    s.wait_for_all(s.arrived(), deadline, timeout, poll);
    // This rank's share of the chunk, from every rank's slot into the result.
    const std::int64_t lo = count * s.rank / s.size;
    const std::int64_t hi = count * (s.rank + 1) / s.size;
    if (hi > lo) {
      const std::size_t at_byte = static_cast<std::size_t>(lo) * element;
      at::Tensor out = view(s.result() + at_byte, hi - lo);
      const auto part = [&](int r) { return view(s.slot(r) + at_byte, hi - lo); };
      for (int r = 1; r < s.size; ++r) {
        const at::Tensor left = r == 1 ? part(0) : out;
        if (op == c10d::ReduceOp::SUM) {
          at::add_out(out, left, part(r));
        } else if (op == c10d::ReduceOp::MAX) {
          at::maximum_out(out, left, part(r));
        } else {
          at::minimum_out(out, left, part(r));
        }
      }
    }
    s.reduced()[s.rank].epoch.store(s.epoch, std::memory_order_release);
    s.wait_for_all(s.reduced(), deadline, timeout, poll);
    std::memcpy(data + static_cast<std::size_t>(offset) * element, s.result(), bytes);
  }
}

c10::intrusive_ptr<c10d::Work> SharedMemoryReduce::run(const at::Tensor& tensor,
                                                       c10d::ReduceOp::RedOpType op,
                                                       std::chrono::milliseconds timeout,
                                                       const std::function<void()>& poll) {
  std::exception_ptr error;
  try {
    all_reduce(tensor, op, timeout, poll);
  } catch (...) {
    error = std::current_exception();
  }
  return c10::make_intrusive<SharedMemoryWork>(tensor, error);
}

} // namespace flotilla::collective::detail
