// Private: what the chief's rendezvous store holds and answers, without sockets. c10d::Store's
// operations (set, get, add, compareSet, deleteKey, check, getNumKeys, wait) with c10d's
// semantics, over one map; the blocking GETs and WAITs, kept until their keys exist or their
// deadline passes; and the bounds that keep the store from growing without limit. The server
// (rendezvous_server.cpp) decodes the requests and sends the answers; this decides them. It is
// used from the server's one thread and locks nothing.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

namespace flotilla::collective::detail {

// Bounds on the whole store (keys and values together).
inline constexpr std::size_t kMaxStoreBytes = 256u << 20;
inline constexpr std::size_t kMaxStoreKeys = 1u << 20;

// An operation the store refuses; what() is the reason the client is told ("the rendezvous
// store is full", "add: the value of \"k\" is not a number"). The store is unchanged by it.
struct KvStoreError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct KvStoreLimits {
  std::size_t bytes = kMaxStoreBytes; // keys and values together
  std::size_t keys = kMaxStoreKeys;
};

class KvStore {
 public:
  using Clock = std::chrono::steady_clock;
  using Bytes = std::vector<std::uint8_t>;

  // A blocked GET (answered with each key's value: one key, or several for a multiGet) or WAIT
  // (answered "present"), kept until every key exists or `deadline` passes.
  struct Waiter {
    int owner = 0; // whom to answer: the server's connection id
    std::vector<std::string> keys;
    // What it is answered with: that the keys exist (WAIT), one value (GET), or a count and the
    // values (multiGet).
    enum class Answer { kPresence, kValue, kValues };
    Answer answer = Answer::kPresence;
    Clock::time_point deadline;
    bool wants_values() const { return answer != Answer::kPresence; }
  };
  // Answers a waiter whose keys all exist: called from inside the operation that completed it
  // (or from wait(), when they already did), before that operation returns. `values` are the
  // GET's values, in the order of its keys; empty for a WAIT. It must not call back into the
  // store.
  using Wake = std::function<void(const Waiter& waiter, const std::vector<const Bytes*>& values)>;

  using Limits = KvStoreLimits;

  explicit KvStore(Wake wake, Limits limits = {});

  // Stores `value` under `key`, then answers the waiters that completes. KvStoreError ("the
  // rendezvous store is full") when it would take the store past its limits.
  void set(const std::string& key, Bytes value);
  // The value under `key`, null when there is none; never blocks (see wait()).
  const Bytes* get(const std::string& key) const;
  // c10d's add: the decimal integer under `key` (0 when absent) plus `delta`, stored back as
  // decimal text; returns the sum. KvStoreError when the value there is not a number.
  std::int64_t add(const std::string& key, std::int64_t delta);
  // c10d's compareSet: `desired` is stored when the value under `key` equals `expected`, or
  // when `key` is absent and `expected` is empty. Returns the value under `key` afterwards; for
  // an absent key with a non-empty `expected`, `expected` itself (and nothing is stored).
  Bytes compare_set(const std::string& key, Bytes expected, Bytes desired);
  // c10d's deleteKey: true when `key` existed.
  bool erase(const std::string& key);
  // c10d's check: whether every one of `keys` exists.
  bool contains(const std::vector<std::string>& keys) const;
  std::size_t num_keys() const { return values_.size(); }
  // What the limit on bytes counts: each key's and value's size, summed.
  std::size_t bytes() const { return bytes_; }

  // Answers `waiter` at once (through Wake) when its keys all exist; keeps it otherwise.
  void wait(Waiter waiter);
  // Removes and returns the kept waiters whose deadline is at or before `now`, to be told
  // they timed out, in the order they came.
  std::vector<Waiter> expire(Clock::time_point now);
  // Drops the kept waiters of `owner` unanswered (its connection is gone).
  void forget(int owner);
  // Removes and returns the kept waiters waiting for a key that starts with one of `prefixes`,
  // to be told they failed (elastic mode: the keys of a generation that lost a member will
  // never come).
  std::vector<Waiter> cancel(const std::vector<std::string>& prefixes);
  // Erases every key that starts with `prefix`; returns how many.
  std::size_t erase_prefix(const std::string& prefix);
  std::size_t num_waiters() const { return waiters_.size(); }

 private:
  // A kept waiter, indexed under the first of its keys that was missing when last looked at
  // (`at`), and under its deadline: a SET wakes only the waiters blocked on its key, and the
  // deadlines are found in order, so neither costs a pass over every waiter (a forming group of
  // 1024 members keeps about 1024 waiters of 128 keys each).
  struct Kept {
    Waiter waiter;
    std::size_t at = 0;
  };
  // Looks at `id`'s keys from `at` on: answers it and returns true once all exist (checked again
  // from the first, in case one was erased meanwhile); otherwise indexes it under the missing one.
  bool advance(std::uint64_t id, Kept& kept);
  void unindex(std::uint64_t id, const Kept& kept);
  void woken_by(const std::string& key);
  void answer(const Waiter& waiter) const;

  Wake wake_;
  Limits limits_;
  std::map<std::string, Bytes> values_;
  std::size_t bytes_ = 0;
  // By arrival, which is the order waiters woken together are answered in.
  std::map<std::uint64_t, Kept> waiters_;
  std::uint64_t next_id_ = 0;
  std::multimap<std::string, std::uint64_t> blocked_on_;
  std::multimap<Clock::time_point, std::uint64_t> deadlines_;
};

} // namespace flotilla::collective::detail
