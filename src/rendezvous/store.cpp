#include "flotilla/rendezvous/store.h"

#include <algorithm>
#include <optional>

#include "rendezvous/connection.h"
#include "rendezvous/wire.h"
#include "flotilla/error.h"

namespace flotilla::collective::detail {

namespace {

using Clock = std::chrono::steady_clock;

void check_key(const std::string& key) {
  if (key.size() > kMaxKeyBytes) {
    throw CommError("a rendezvous key of " + std::to_string(key.size()) +
                    " bytes is over the limit of " + std::to_string(kMaxKeyBytes));
  }
}

void check_value(const Bytes& value) {
  if (value.size() > kMaxValueBytes) {
    throw CommError("a rendezvous value of " + std::to_string(value.size()) +
                    " bytes is over the limit of " + std::to_string(kMaxValueBytes));
  }
}

std::string set_frame(const std::string& key, const Bytes& value) {
  check_key(key);
  check_value(value);
  WireWriter w;
  w.u8(kSet).str(key).bytes(value);
  return w.frame();
}

std::uint32_t wire_ms(std::chrono::milliseconds d) {
  return static_cast<std::uint32_t>(std::clamp<std::int64_t>(d.count(), 0, 0x7fffffff));
}

// A request that names several keys and waits for them all (a WAIT, a multiGet), the server
// answering by `wait`. `doing` names it in the error for too many keys ("waiting for").
std::string keys_frame(std::uint8_t op, const std::vector<std::string>& keys,
                       std::chrono::milliseconds wait, const char* doing) {
  if (keys.size() > kMaxKeysPerRequest) {
    throw CommError(std::string(doing) + " " + std::to_string(keys.size()) +
                    " rendezvous keys at once is over the limit of " +
                    std::to_string(kMaxKeysPerRequest));
  }
  WireWriter w;
  w.u8(op).u32(static_cast<std::uint32_t>(keys.size()));
  for (const auto& k : keys) check_key(k), w.str(k);
  w.u32(wire_ms(wait));
  return w.frame();
}

} // namespace

RendezvousStore::RendezvousStore(const RendezvousConfig& config)
    : c10d::Store(config.timeout), config_(config) {
  connect(Clock::now() + config_.timeout);
}

RendezvousStore::~RendezvousStore() = default;

c10::intrusive_ptr<c10d::Store> RendezvousStore::clone() {
  // Same process, same session: the chief accepts a second connection for this rank.
  return c10::make_intrusive<RendezvousStore>(config_);
}

void RendezvousStore::connect(Clock::time_point deadline) {
  connection_ = Connection::join(config_, kRoleStore, deadline);
}

void RendezvousStore::reconnect(Clock::time_point deadline) {
  std::lock_guard<std::mutex> lock(mutex_);
  connection_.reset();
  connect(deadline);
}

Bytes RendezvousStore::request(const std::string& frame, std::chrono::milliseconds wait,
                               bool reconnect) {
  std::lock_guard<std::mutex> lock(mutex_);
  std::string body;
  // Elastic: a lost connection is joined again (naming this process's generation) and the
  // request repeated, until the rendezvous timeout. Only a restarted server can take it back (a
  // running one has released the slot of a process whose connection closed), and it holds none
  // of the keys of before: every request means there what it meant.
  const auto give_up = Clock::now() + config_.timeout;
  for (;;) {
    if (!connection_) {
      // A fixed group's chief-hosted rendezvous cannot come back: its loss was final.
      if (!reconnect || !config_.standing) {
        throw CommError("the connection to the rendezvous at " + config_.chief.to_string() +
                        " was lost earlier; this rank cannot use its store any more");
      }
      connect(give_up);
    }
    // The chief answers a blocking request at its own deadline; allow for the trip.
    const auto deadline = Clock::now() + wait + std::chrono::seconds(5);
    try {
      connection_->send(frame, deadline);
      body = connection_->receive(deadline);
      break;
    } catch (const ConnectionLost&) {
      connection_.reset();
      if (!config_.standing || !reconnect) throw;
    } catch (const TimeoutError&) {
      connection_.reset(); // its answer may still come: the next request must not read it
      throw;
    }
  }
  WireReader in(body);
  try {
    const std::uint8_t status = in.u8();
    if (status == kTimedOut) {
      throw TimeoutError("Timed out after " + ms_text(wait) +
                         " waiting for keys in the chief's rendezvous store at " +
                         connection_->chief());
    }
    if (status == kFailed) {
      throw CommError("the chief's rendezvous store at " + connection_->chief() +
                      " failed a request: " + in.str(kMaxReasonBytes));
    }
    return {body.begin() + 1, body.end()};
  } catch (const WireError& e) {
    throw CommError("the chief at " + connection_->chief() + " sent a malformed answer (" +
                    e.what() + ")");
  }
}

bool RendezvousStore::set_if_connected(const std::string& key, const Bytes& value) {
  const std::string frame = set_frame(key, value); // a key over the bounds is an error still
  try {
    request(frame, std::chrono::milliseconds(0), /*reconnect=*/false);
    return true;
  } catch (const CommError&) {
    return false;
  }
}

std::optional<Bytes> RendezvousStore::get_if_connected(const std::string& key) {
  check_key(key);
  WireWriter w;
  w.u8(kGet).str(key).u32(0);
  try {
    const Bytes answer = request(w.frame(), std::chrono::milliseconds(0), /*reconnect=*/false);
    WireReader in(answer.data(), answer.size());
    return in.bytes(kMaxValueBytes);
  } catch (const CommError&) { // lost, absent (a TimeoutError) or refused
    return std::nullopt;
  }
}

void RendezvousStore::set(const std::string& key, const Bytes& value) {
  request(set_frame(key, value), std::chrono::milliseconds(0));
}

Bytes RendezvousStore::compareSet(const std::string& key, const Bytes& expected,
                                  const Bytes& desired) {
  check_key(key);
  check_value(expected);
  check_value(desired);
  WireWriter w;
  w.u8(kCompareSet).str(key).bytes(expected).bytes(desired);
  const Bytes answer = request(w.frame(), std::chrono::milliseconds(0));
  WireReader in(answer.data(), answer.size());
  return in.bytes(kMaxValueBytes);
}

Bytes RendezvousStore::get(const std::string& key) {
  check_key(key);
  WireWriter w;
  w.u8(kGet).str(key).u32(wire_ms(timeout_));
  const Bytes answer = request(w.frame(), timeout_);
  WireReader in(answer.data(), answer.size());
  return in.bytes(kMaxValueBytes);
}

std::vector<Bytes> RendezvousStore::multiGet(const std::vector<std::string>& keys) {
  const Bytes answer = request(keys_frame(kMultiGet, keys, timeout_, "reading"), timeout_);
  WireReader in(answer.data(), answer.size());
  try {
    const std::uint32_t n = in.u32();
    if (n != keys.size()) {
      throw WireError(std::to_string(n) + " values for " + std::to_string(keys.size()) + " keys");
    }
    std::vector<Bytes> values;
    for (std::uint32_t i = 0; i < n; ++i) values.push_back(in.bytes(kMaxValueBytes));
    return values;
  } catch (const WireError& e) {
    throw CommError("the rendezvous at " + config_.chief.to_string() +
                    " sent a malformed answer to a multiGet (" + e.what() + ")");
  }
}

std::int64_t RendezvousStore::add(const std::string& key, std::int64_t value) {
  check_key(key);
  WireWriter w;
  w.u8(kAdd).str(key).i64(value);
  const Bytes answer = request(w.frame(), std::chrono::milliseconds(0));
  WireReader in(answer.data(), answer.size());
  return in.i64();
}

bool RendezvousStore::deleteKey(const std::string& key) {
  check_key(key);
  WireWriter w;
  w.u8(kDelete).str(key);
  const Bytes answer = request(w.frame(), std::chrono::milliseconds(0));
  return !answer.empty() && answer[0] != 0;
}

bool RendezvousStore::check(const std::vector<std::string>& keys) {
  WireWriter w;
  w.u8(kCheck).u32(static_cast<std::uint32_t>(keys.size()));
  for (const auto& k : keys) check_key(k), w.str(k);
  const Bytes answer = request(w.frame(), std::chrono::milliseconds(0));
  return !answer.empty() && answer[0] != 0;
}

std::int64_t RendezvousStore::getNumKeys() {
  WireWriter w;
  w.u8(kNumKeys);
  const Bytes answer = request(w.frame(), std::chrono::milliseconds(0));
  WireReader in(answer.data(), answer.size());
  return in.i64();
}

std::uint64_t RendezvousStore::advance(std::uint64_t from) {
  WireWriter w;
  w.u8(kAdvance).i64(static_cast<std::int64_t>(from));
  const Bytes answer = request(w.frame(), std::chrono::milliseconds(0));
  WireReader in(answer.data(), answer.size());
  return static_cast<std::uint64_t>(in.i64());
}

void RendezvousStore::wait(const std::vector<std::string>& keys) {
  wait(keys, timeout_);
}

void RendezvousStore::wait(const std::vector<std::string>& keys,
                           const std::chrono::milliseconds& timeout) {
  request(keys_frame(kWait, keys, timeout, "waiting for"), timeout);
}

void RendezvousStore::wait_for_all_ranks() {
  std::vector<std::string> keys;
  for (int r = 0; r < config_.world_size; ++r) {
    keys.push_back("flotilla/joined/" + std::to_string(r));
  }
  try {
    // In requests of at most kMaxKeysPerRequest keys (it capped a fixed group at 4096 ranks),
    // within one timeout in all.
    const auto deadline = Clock::now() + config_.timeout;
    for (std::size_t from = 0; from < keys.size(); from += kMaxKeysPerRequest) {
      const std::vector<std::string> part(
          keys.begin() + static_cast<std::ptrdiff_t>(from),
          keys.begin() + static_cast<std::ptrdiff_t>(std::min(keys.size(), from + kMaxKeysPerRequest)));
      const auto left =
          std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
      wait(part, std::max(std::chrono::milliseconds(0), left));
    }
  } catch (const TimeoutError&) {
    std::vector<std::string> missing;
    for (int r = 0; r < config_.world_size; ++r) {
      if (!check({keys[static_cast<std::size_t>(r)]})) missing.push_back(config_.name(r));
    }
    std::string names;
    for (std::size_t i = 0; i < missing.size(); ++i) {
      names += (i == 0 ? "" : i + 1 == missing.size() ? " and " : ", ") + missing[i];
    }
    throw TimeoutError(config_.name(config_.rank) + ": rendezvous with the chief at " +
                       config_.chief.to_string() + ": " +
                       std::to_string(config_.world_size - static_cast<int>(missing.size())) +
                       " of " + std::to_string(config_.world_size) + " joined within " +
                       ms_text(config_.timeout) + "; " + names +
                       " did not join; start every task TF_CONFIG lists, check that each can "
                       "reach the chief, or raise CommunicationOptions::timeout");
  }
}

} // namespace flotilla::collective::detail
