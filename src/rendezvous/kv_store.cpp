#include "rendezvous/kv_store.h"

#include <algorithm>
#include <utility>

namespace flotilla::collective::detail {

namespace {
const char* const kFull = "the rendezvous store is full";
} // namespace

KvStore::KvStore(Wake wake, Limits limits) : wake_(std::move(wake)), limits_(limits) {}

void KvStore::set(const std::string& key, Bytes value) {
  auto it = values_.find(key);
  const std::size_t old = it == values_.end() ? 0 : key.size() + it->second.size();
  const std::size_t after = bytes_ - old + key.size() + value.size();
  if (after > limits_.bytes || (it == values_.end() && values_.size() >= limits_.keys)) {
    throw KvStoreError(kFull);
  }
  bytes_ = after;
  if (it == values_.end()) {
    values_.emplace(key, std::move(value));
    woken_by(key); // a value replaced completes no waiter: its key existed already
  } else {
    it->second = std::move(value);
  }
}

const KvStore::Bytes* KvStore::get(const std::string& key) const {
  auto it = values_.find(key);
  return it == values_.end() ? nullptr : &it->second;
}

std::int64_t KvStore::add(const std::string& key, std::int64_t delta) {
  std::int64_t value = 0;
  if (const Bytes* current = get(key)) {
    try {
      value = std::stoll(std::string(current->begin(), current->end()));
    } catch (const std::exception&) {
      throw KvStoreError("add: the value of \"" + key + "\" is not a number");
    }
  }
  // Wraps around past the int64 range (as two's complement does) instead of overflowing: a
  // client's delta must not be able to reach undefined behaviour in the chief.
  value = static_cast<std::int64_t>(static_cast<std::uint64_t>(value) +
                                    static_cast<std::uint64_t>(delta));
  const std::string text = std::to_string(value);
  set(key, Bytes(text.begin(), text.end()));
  return value;
}

KvStore::Bytes KvStore::compare_set(const std::string& key, Bytes expected, Bytes desired) {
  const Bytes* current = get(key);
  if (current == nullptr) {
    if (!expected.empty()) return expected;
  } else if (*current != expected) {
    return *current;
  }
  set(key, desired);
  return desired;
}

bool KvStore::erase(const std::string& key) {
  auto it = values_.find(key);
  if (it == values_.end()) return false;
  bytes_ -= key.size() + it->second.size();
  values_.erase(it);
  return true;
}

bool KvStore::contains(const std::vector<std::string>& keys) const {
  return std::all_of(keys.begin(), keys.end(),
                     [&](const std::string& k) { return values_.count(k) > 0; });
}

void KvStore::answer(const Waiter& waiter) const {
  std::vector<const Bytes*> values;
  if (waiter.wants_values()) {
    for (const auto& key : waiter.keys) values.push_back(&values_.at(key));
  }
  wake_(waiter, values);
}

void KvStore::wait(Waiter waiter) {
  const std::uint64_t id = next_id_++;
  Kept kept{std::move(waiter), 0};
  if (advance(id, kept)) return;
  deadlines_.emplace(kept.waiter.deadline, id);
  waiters_.emplace(id, std::move(kept));
}

bool KvStore::advance(std::uint64_t id, Kept& kept) {
  const auto& keys = kept.waiter.keys;
  for (bool again = false;; again = true) {
    while (kept.at < keys.size() && values_.count(keys[kept.at]) > 0) ++kept.at;
    if (kept.at < keys.size()) {
      blocked_on_.emplace(keys[kept.at], id);
      return false;
    }
    if (again || contains(keys)) break;
    kept.at = 0; // one was erased since it was passed
  }
  answer(kept.waiter);
  return true;
}

void KvStore::unindex(std::uint64_t id, const Kept& kept) {
  const auto drop = [id](auto& index, const auto& key) {
    auto [from, to] = index.equal_range(key);
    for (auto it = from; it != to; ++it) {
      if (it->second == id) {
        index.erase(it);
        return;
      }
    }
  };
  if (kept.at < kept.waiter.keys.size()) drop(blocked_on_, kept.waiter.keys[kept.at]);
  drop(deadlines_, kept.waiter.deadline);
}

void KvStore::woken_by(const std::string& key) {
  auto [from, to] = blocked_on_.equal_range(key);
  if (from == to) return;
  std::vector<std::uint64_t> ids;
  for (auto it = from; it != to; ++it) ids.push_back(it->second);
  blocked_on_.erase(from, to);
  std::sort(ids.begin(), ids.end());
  for (const std::uint64_t id : ids) {
    auto it = waiters_.find(id);
    if (it == waiters_.end()) continue;
    if (advance(id, it->second)) {
      unindex(id, it->second); // answered: past its last key, so only its deadline is left
      waiters_.erase(it);
    }
  }
}

std::vector<KvStore::Waiter> KvStore::expire(Clock::time_point now) {
  std::vector<std::uint64_t> ids;
  for (auto it = deadlines_.begin(); it != deadlines_.end() && it->first <= now; ++it) {
    ids.push_back(it->second);
  }
  std::sort(ids.begin(), ids.end());
  std::vector<Waiter> expired;
  for (const std::uint64_t id : ids) {
    auto it = waiters_.find(id);
    unindex(id, it->second);
    expired.push_back(std::move(it->second.waiter));
    waiters_.erase(it);
  }
  return expired;
}

void KvStore::forget(int owner) {
  for (auto it = waiters_.begin(); it != waiters_.end();) {
    if (it->second.waiter.owner == owner) {
      unindex(it->first, it->second);
      it = waiters_.erase(it);
    } else {
      ++it;
    }
  }
}

std::vector<KvStore::Waiter> KvStore::cancel(const std::vector<std::string>& prefixes) {
  const auto waits_for_one = [&](const Waiter& w) {
    return std::any_of(w.keys.begin(), w.keys.end(), [&](const std::string& key) {
      return std::any_of(prefixes.begin(), prefixes.end(),
                         [&](const std::string& p) { return key.compare(0, p.size(), p) == 0; });
    });
  };
  std::vector<Waiter> cancelled;
  for (auto it = waiters_.begin(); it != waiters_.end();) {
    if (waits_for_one(it->second.waiter)) {
      unindex(it->first, it->second);
      cancelled.push_back(std::move(it->second.waiter));
      it = waiters_.erase(it);
    } else {
      ++it;
    }
  }
  return cancelled;
}

std::size_t KvStore::erase_prefix(const std::string& prefix) {
  std::size_t n = 0;
  for (auto it = values_.lower_bound(prefix);
       it != values_.end() && it->first.compare(0, prefix.size(), prefix) == 0;) {
    bytes_ -= it->first.size() + it->second.size();
    it = values_.erase(it);
    ++n;
  }
  return n;
}

} // namespace flotilla::collective::detail
