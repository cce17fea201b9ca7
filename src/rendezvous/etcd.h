// Private: the few calls of etcd's v3 API that the replicated rendezvous needs, over its JSON
// gateway (HTTP/1.1 POST to /v3/..., keys and values in base64; etcd 3.4 and later serve it on
// their client URLs), through libcurl: plain HTTP or TLS with server verification and client
// certificates, and etcd's authentication token. A call is rare (a lookup after a lost
// connection, a lease renewal a second); each endpoint keeps its connection between calls.
#pragma once

#include <chrono>
#include <memory>
#include <cstdint>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "flotilla/cluster/cluster_spec.h"

namespace flotilla::collective::detail {

class EtcdClient {
 public:
  // Each call tries the endpoints in turn, from the last one that answered, each for up to
  // `timeout`; one that cannot answer (down, or cut off from its cluster's quorum) is skipped.
  // CommError naming every endpoint and why when none answers. ConfigError, at once, where
  // etcd answered but refused this client for what it was given (a certificate it does not
  // trust or that does not verify, TLS against plain HTTP or the reverse, a wrong user or
  // password, no rights to the key): trying again cannot help.
  EtcdClient(const cluster::EtcdRendezvous& etcd, std::chrono::milliseconds timeout);
  ~EtcdClient();

  std::optional<std::string> get(const std::string& key);
  // A lease of `ttl_s` seconds; its ID.
  std::int64_t grant(std::int64_t ttl_s);
  // Renews `lease`; the seconds it has left, 0 when it had expired (or never was).
  std::int64_t keep_alive(std::int64_t lease);
  // Puts `key` = `value` under `lease` if no such key exists (one transaction); true if it did.
  bool create(const std::string& key, const std::string& value, std::int64_t lease);
  // Ends `lease` and deletes its keys.
  void revoke(std::int64_t lease);
  // Whether `key` is held by `lease`, read linearizably (through the quorum's leader) at the
  // endpoint that answered the last call only: after keep_alive, true means the renewal reached
  // the leader of a quorum (a member cut off with a minority, even one that still believes it
  // leads, answers a renewal but cannot answer this read). False when that endpoint cannot answer.
  bool holds(const std::string& key, std::int64_t lease);

 private:
  struct Endpoint;
  // The answer, parsed once; CommError for a gRPC error in it.
  nlohmann::json call(const std::string& path, const std::string& body);
  nlohmann::json post_to(std::size_t endpoint, const std::string& path, const std::string& body);
  // One POST, its body when etcd answered 200; with the authentication token when there is a
  // user (asked for first, and again once when etcd says it expired).
  std::string post(Endpoint& to, const std::string& path, const std::string& body);
  std::string exchange(Endpoint& to, const std::string& path, const std::string& body,
                       const std::string& token);
  // After a call broke in or before its TLS handshake: ConfigError where a handshake of its
  // own shows etcd refusing this client's certificate, or TLS on one side only. `why`: the
  // call's own error.
  void diagnose(const Endpoint& to, const std::string& why) const;
  void use_certificates(void* curl_handle) const;

  std::mutex mutex_;
  cluster::EtcdRendezvous etcd_;
  std::vector<std::unique_ptr<Endpoint>> endpoints_;
  std::size_t next_ = 0;
  std::chrono::milliseconds timeout_;
  std::string token_; // etcd's authentication token, "" until asked for
};

// base64 (RFC 4648, with padding), as the gateway writes bytes.
std::string base64(const std::string& bytes);
// nullopt when `text` is not base64.
std::optional<std::string> unbase64(const std::string& text);

} // namespace flotilla::collective::detail
