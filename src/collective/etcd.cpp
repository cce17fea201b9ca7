#include "collective/etcd.h"

#include <poll.h>
#include <unistd.h>

#include <cstring>
#include <nlohmann/json.hpp>
#include <openssl/evp.h>

#include "collective/sockets.h"
#include "flotilla/error.h"

namespace flotilla::collective::detail {
namespace {

using nlohmann::json;
using Clock = std::chrono::steady_clock;

constexpr std::size_t kMaxResponseBytes = 1 << 20;

bool wait_for(int fd, short events, Clock::time_point deadline) {
  for (;;) {
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    if (left <= 0) return false;
    pollfd p{fd, events, 0};
    const int n = ::poll(&p, 1, static_cast<int>(left));
    if (n > 0) return true;
    if (n < 0 && errno != EINTR) return false;
  }
}

// The body of a chunked HTTP response.
std::string unchunk(const std::string& raw) {
  std::string out;
  std::size_t at = 0;
  for (;;) {
    const auto eol = raw.find("\r\n", at);
    if (eol == std::string::npos) throw CommError("a chunked response ends early");
    const std::size_t size = std::stoul(raw.substr(at, eol - at), nullptr, 16);
    if (size == 0) return out;
    if (eol + 2 + size > raw.size()) throw CommError("a chunk runs past the response");
    out.append(raw, eol + 2, size);
    at = eol + 2 + size + 2;
  }
}

// One POST of `body` to http://<to><path>; the response's body when its status is 200.
std::string post(const cluster::Address& to, const std::string& path, const std::string& body,
                 Clock::time_point deadline) {
  AddrInfo found;
  resolve(to, found);
  const int fd = ::socket(found.list->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) throw CommError(std::strerror(errno));
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  if (!connect_within(fd, found.list, deadline)) {
    throw CommError(errno == ETIMEDOUT ? "no connection in time" : std::strerror(errno));
  }
  const std::string request =
      "POST " + path + " HTTP/1.1\r\nHost: " + to.to_string() +
      "\r\nContent-Type: application/json\r\nContent-Length: " + std::to_string(body.size()) +
      "\r\nConnection: close\r\n\r\n" + body;
  for (std::size_t sent = 0; sent < request.size();) {
    if (!wait_for(fd, POLLOUT, deadline)) throw CommError("no answer in time");
    const ssize_t n = ::send(fd, request.data() + sent, request.size() - sent, MSG_NOSIGNAL);
    if (n < 0 && (errno == EINTR || errno == EAGAIN)) continue;
    if (n <= 0) throw CommError(std::strerror(errno));
    sent += static_cast<std::size_t>(n);
  }
  std::string raw;
  char buffer[16384];
  for (;;) {
    if (!wait_for(fd, POLLIN, deadline)) throw CommError("no answer in time");
    const ssize_t n = ::recv(fd, buffer, sizeof buffer, 0);
    if (n < 0 && (errno == EINTR || errno == EAGAIN)) continue;
    if (n < 0) throw CommError(std::strerror(errno));
    if (n == 0) break;
    raw.append(buffer, static_cast<std::size_t>(n));
    if (raw.size() > kMaxResponseBytes) throw CommError("an answer over 1 MiB");
  }
  const auto head_end = raw.find("\r\n\r\n");
  if (raw.rfind("HTTP/1.", 0) != 0 || head_end == std::string::npos) {
    throw CommError("an answer that is not HTTP");
  }
  const std::string status = raw.substr(9, 3);
  std::string head = raw.substr(0, head_end);
  for (auto& c : head) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  std::string content = raw.substr(head_end + 4);
  if (head.find("transfer-encoding: chunked") != std::string::npos) content = unchunk(content);
  if (status != "200") {
    throw CommError("HTTP " + status + ": " + content.substr(0, 200));
  }
  return content;
}

json parse(const std::string& text) {
  try {
    // A streaming call (lease keep-alive) answers one JSON document per line; the first is ours.
    return json::parse(text.substr(0, text.find('\n')));
  } catch (const json::exception& e) {
    throw CommError(std::string("an answer that is not JSON (") + e.what() + ")");
  }
}

std::int64_t number(const json& j, const char* field) {
  if (!j.contains(field)) return 0; // proto3's JSON leaves zeros out
  const auto& v = j.at(field);
  return v.is_string() ? std::stoll(v.get<std::string>()) : v.get<std::int64_t>();
}

} // namespace

std::string base64(const std::string& bytes) {
  std::string out(4 * ((bytes.size() + 2) / 3) + 1, '\0');
  const int n = EVP_EncodeBlock(reinterpret_cast<unsigned char*>(out.data()),
                                reinterpret_cast<const unsigned char*>(bytes.data()),
                                static_cast<int>(bytes.size()));
  out.resize(static_cast<std::size_t>(n));
  return out;
}

std::optional<std::string> unbase64(const std::string& text) {
  if (text.size() % 4 != 0) return std::nullopt;
  std::string out(text.size() / 4 * 3 + 1, '\0');
  const int n = EVP_DecodeBlock(reinterpret_cast<unsigned char*>(out.data()),
                                reinterpret_cast<const unsigned char*>(text.data()),
                                static_cast<int>(text.size()));
  if (n < 0) return std::nullopt;
  std::size_t size = static_cast<std::size_t>(n);
  for (std::size_t i = text.size(); i > 0 && text[i - 1] == '='; --i) --size;
  out.resize(size);
  return out;
}

EtcdClient::EtcdClient(std::vector<cluster::Address> endpoints, std::chrono::milliseconds timeout)
    : endpoints_(std::move(endpoints)), timeout_(timeout) {}

nlohmann::json EtcdClient::post_to(std::size_t at, const std::string& path,
                                   const std::string& body) {
  json j = parse(post(endpoints_[at], path, body, Clock::now() + timeout_));
  // A gRPC error in JSON (e.g. a member without its cluster's quorum).
  if (j.contains("error") || (j.contains("code") && !j.contains("header"))) {
    throw CommError(j.value("message", j.dump()));
  }
  return j;
}

nlohmann::json EtcdClient::call(const std::string& path, const std::string& body) {
  std::lock_guard<std::mutex> lock(mutex_);
  std::string failures;
  for (std::size_t i = 0; i < endpoints_.size(); ++i) {
    const std::size_t at = (next_ + i) % endpoints_.size();
    try {
      json answer = post_to(at, path, body);
      next_ = at;
      return answer;
    } catch (const Error& e) {
      failures += (failures.empty() ? "" : "; ") + endpoints_[at].to_string() + ": " + e.what();
    }
  }
  next_ = (next_ + 1) % endpoints_.size();
  throw CommError("no etcd endpoint answered " + path + " (" + failures + ")");
}

std::optional<std::string> EtcdClient::get(const std::string& key) {
  const json j = call("/v3/kv/range", json{{"key", base64(key)}}.dump());
  if (!j.contains("kvs") || j["kvs"].empty()) return std::nullopt;
  const auto value = unbase64(j["kvs"][0].value("value", ""));
  if (!value) throw CommError("etcd answered a value that is not base64 for " + key);
  return value;
}

std::int64_t EtcdClient::grant(std::int64_t ttl_s) {
  const json j = call("/v3/lease/grant", json{{"TTL", ttl_s}}.dump());
  const std::int64_t id = number(j, "ID");
  if (id == 0) throw CommError("etcd granted no lease: " + j.dump());
  return id;
}

std::int64_t EtcdClient::keep_alive(std::int64_t lease) {
  const json j = call("/v3/lease/keepalive", json{{"ID", std::to_string(lease)}}.dump());
  return number(j.value("result", json::object()), "TTL");
}

bool EtcdClient::create(const std::string& key, const std::string& value, std::int64_t lease) {
  const json txn = {
      {"compare",
       {{{"key", base64(key)},
         {"result", "EQUAL"},
         {"target", "CREATE"},
         {"create_revision", "0"}}}},
      {"success",
       {{{"request_put",
          {{"key", base64(key)}, {"value", base64(value)}, {"lease", std::to_string(lease)}}}}}}};
  return call("/v3/kv/txn", txn.dump()).value("succeeded", false);
}

bool EtcdClient::holds(const std::string& key, std::int64_t lease) {
  std::lock_guard<std::mutex> lock(mutex_);
  try {
    const json j = post_to(next_, "/v3/kv/range", json{{"key", base64(key)}}.dump());
    return j.contains("kvs") && !j["kvs"].empty() && number(j["kvs"][0], "lease") == lease;
  } catch (const Error&) {
    return false;
  }
}

void EtcdClient::revoke(std::int64_t lease) {
  call("/v3/lease/revoke", json{{"ID", std::to_string(lease)}}.dump());
}

} // namespace flotilla::collective::detail
