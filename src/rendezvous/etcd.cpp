#include "rendezvous/etcd.h"

#include <curl/curl.h>

#include <nlohmann/json.hpp>
#include <openssl/evp.h>

#include "flotilla/error.h"

namespace flotilla::collective::detail {

struct EtcdClient::Endpoint {
  cluster::Address address;
  std::string base; // "https://HOST:PORT"
  CURL* curl = nullptr;
  ~Endpoint() {
    if (curl) curl_easy_cleanup(curl);
  }
};

namespace {

using nlohmann::json;

constexpr std::size_t kMaxResponseBytes = 1 << 20;

// etcd says the token it issued has expired: authenticate again.
struct ExpiredToken : CommError {
  using CommError::CommError;
};

std::size_t collect(char* data, std::size_t size, std::size_t n, void* to) {
  auto& out = *static_cast<std::string*>(to);
  if (out.size() + size * n > kMaxResponseBytes) return 0; // libcurl stops: CURLE_WRITE_ERROR
  out.append(data, size * n);
  return size * n;
}

bool contains(const std::string& text, const char* what) {
  return text.find(what) != std::string::npos;
}

// What etcd said when it refused a call: ConfigError where the client's credentials are at
// fault, ExpiredToken for an expired token, CommError otherwise.
[[noreturn]] void refused(const cluster::EtcdRendezvous& etcd, const std::string& where,
                          const std::string& message) {
  const std::string said = where + " answered " + echoed(message);
  if (contains(message, "invalid auth token")) throw ExpiredToken(said);
  if (contains(message, "permission denied")) {
    throw ConfigError(said + ": the etcd user " + echoed(etcd.user, 80) +
                      " may not read and write this job's keys; grant its role them, e.g. "
                      "etcdctl role grant-permission ROLE --prefix=true readwrite /flotilla/" +
                      etcd.job + "/");
  }
  if (contains(message, "authentication failed")) {
    throw ConfigError(said + ": check the etcd user (--etcd-user or FLOTILLA_ETCD_USER, " +
                      echoed(etcd.user, 80) + ") and its password (FLOTILLA_ETCD_PASSWORD)");
  }
  if (contains(message, "user name is empty")) {
    throw ConfigError(said + ": this etcd requires authentication; give an etcd user "
                      "(--etcd-user or FLOTILLA_ETCD_USER) and FLOTILLA_ETCD_PASSWORD");
  }
  if (contains(message, "CommonName of client")) {
    throw ConfigError(said + ": with its authentication on, etcd's JSON gateway refuses a client "
                      "certificate that has a Common Name; give flotilla one without (e.g. "
                      "openssl req -subj /O=flotilla), its user comes from --etcd-user");
  }
  throw CommError(said);
}

// The message of a gRPC error as the gateway writes it: {"error": "...", "code": 7, "message":
// "..."}, or a stream's {"error": {"grpc_code": 7, "message": "..."}}.
std::string message_of(const json& j) {
  if (!j.is_object()) return j.dump();
  const json& e = j.contains("error") && j["error"].is_object() ? j["error"] : j;
  for (const char* field : {"message", "error"}) {
    if (e.contains(field) && e[field].is_string()) return e[field].get<std::string>();
  }
  return j.dump();
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

EtcdClient::EtcdClient(const cluster::EtcdRendezvous& etcd, std::chrono::milliseconds timeout)
    : etcd_(etcd), timeout_(timeout) {
  static const CURLcode global = curl_global_init(CURL_GLOBAL_DEFAULT); // once, thread-safe
  if (global != CURLE_OK) throw CommError("libcurl: " + std::string(curl_easy_strerror(global)));
  for (const auto& address : etcd_.endpoints) {
    auto e = std::make_unique<Endpoint>();
    e->address = address;
    e->base = (etcd_.tls ? "https://" : "http://") + address.to_string();
    e->curl = curl_easy_init();
    if (!e->curl) throw CommError("libcurl could not make a handle");
    endpoints_.push_back(std::move(e));
  }
}

EtcdClient::~EtcdClient() = default;

void EtcdClient::use_certificates(void* handle) const {
  CURL* c = handle;
  if (!etcd_.ca_file.empty()) curl_easy_setopt(c, CURLOPT_CAINFO, etcd_.ca_file.c_str());
  if (!etcd_.cert_file.empty()) curl_easy_setopt(c, CURLOPT_SSLCERT, etcd_.cert_file.c_str());
  if (!etcd_.key_file.empty()) curl_easy_setopt(c, CURLOPT_SSLKEY, etcd_.key_file.c_str());
}

void EtcdClient::diagnose(const Endpoint& to, const std::string& why) const {
  const std::string where = "etcd at " + to.base;
  const auto refused_certificate = [](const std::string& said) {
    for (const char* alert : {"alert bad certificate", "alert certificate required",
                              "alert unknown ca", "alert certificate unknown",
                              "alert unsupported certificate", "alert certificate expired",
                              "alert certificate revoked", "alert access denied"}) {
      if (contains(said, alert)) return true;
    }
    return false;
  };
  // One request of its own on a fresh handle: its error, "" when it succeeded.
  const auto probe = [&](const std::string& url, bool connect_only, bool tls) {
    CURL* c = curl_easy_init();
    if (!c) return std::string("libcurl could not make a handle");
    struct Cleanup {
      CURL* c;
      ~Cleanup() { curl_easy_cleanup(c); }
    } cleanup{c};
    char error[CURL_ERROR_SIZE] = "";
    std::string ignored;
    curl_easy_setopt(c, CURLOPT_URL, url.c_str());
    curl_easy_setopt(c, CURLOPT_CONNECT_ONLY, connect_only ? 1L : 0L);
    curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, collect);
    curl_easy_setopt(c, CURLOPT_WRITEDATA, &ignored);
    curl_easy_setopt(c, CURLOPT_ERRORBUFFER, error);
    curl_easy_setopt(c, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(c, CURLOPT_TIMEOUT_MS, static_cast<long>(timeout_.count()));
    if (tls && etcd_.tls) {
      use_certificates(c);
      curl_easy_setopt(c, CURLOPT_SSLVERSION,
                       static_cast<long>(CURL_SSLVERSION_DEFAULT | CURL_SSLVERSION_MAX_TLSv1_2));
    } else if (tls) { // only: does it speak TLS at all?
      curl_easy_setopt(c, CURLOPT_SSL_VERIFYPEER, 0L);
      curl_easy_setopt(c, CURLOPT_SSL_VERIFYHOST, 0L);
    }
    const CURLcode rc = curl_easy_perform(c);
    return rc == CURLE_OK ? std::string() : std::string(error[0] ? error : curl_easy_strerror(rc));
  };
  const std::string address = to.address.to_string();
  if (!etcd_.tls) {
    // Over plain HTTP: whether a TLS handshake (unverified, sending nothing) succeeds there.
    if (probe("https://" + address + "/", true, true).empty()) {
      throw ConfigError(where + " answered nothing (" + why +
                        "), and it speaks TLS there; write etcds:// instead of etcd://");
    }
    return;
  }
  // A handshake alone says what a broken call may not: under TLS 1.3 etcd checks the client's
  // certificate after the client's handshake ends, so the call's own failure reads as a reset
  // or an empty reply; TLS 1.2 reports the alert in the handshake.
  std::string said = why;
  if (!refused_certificate(said)) said = probe("https://" + address + "/", true, true);
  if (refused_certificate(said)) {
    throw ConfigError(where + " refused this client in the TLS handshake (" + said +
                      "); it wants a client certificate signed by a CA it trusts "
                      "(--etcd-cert and --etcd-key, or FLOTILLA_ETCD_CERT and _KEY)");
  }
  // No TLS there: a plain HTTP server answers its /version.
  if (contains(said, "wrong version number") ||
      (!said.empty() && probe("http://" + address + "/version", false, false).empty())) {
    throw ConfigError(where + ": no TLS there (" + said + "; it answers plain HTTP); write "
                      "etcd:// for plain HTTP");
  }
}

std::string EtcdClient::exchange(Endpoint& to, const std::string& path, const std::string& body,
                                 const std::string& token) {
  CURL* c = to.curl;
  curl_easy_reset(c); // keeps the connection (and TLS session) for the next call
  const std::string url = to.base + path;
  std::string answer;
  char error[CURL_ERROR_SIZE] = "";
  curl_slist* headers = curl_slist_append(nullptr, "Content-Type: application/json");
  if (!token.empty()) headers = curl_slist_append(headers, ("Authorization: " + token).c_str());
  struct Free {
    curl_slist* list;
    ~Free() { curl_slist_free_all(list); }
  } free_headers{headers};
  curl_easy_setopt(c, CURLOPT_URL, url.c_str());
  curl_easy_setopt(c, CURLOPT_PROTOCOLS_STR, "http,https");
  curl_easy_setopt(c, CURLOPT_HTTP_VERSION, static_cast<long>(CURL_HTTP_VERSION_1_1));
  curl_easy_setopt(c, CURLOPT_POSTFIELDS, body.data());
  curl_easy_setopt(c, CURLOPT_POSTFIELDSIZE, static_cast<long>(body.size()));
  curl_easy_setopt(c, CURLOPT_HTTPHEADER, headers);
  curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, collect);
  curl_easy_setopt(c, CURLOPT_WRITEDATA, &answer);
  curl_easy_setopt(c, CURLOPT_ERRORBUFFER, error);
  curl_easy_setopt(c, CURLOPT_NOSIGNAL, 1L);
  curl_easy_setopt(c, CURLOPT_TIMEOUT_MS, static_cast<long>(timeout_.count()));
  if (etcd_.tls) use_certificates(c);
  const CURLcode rc = curl_easy_perform(c);
  const std::string where = "etcd at " + to.base;
  if (rc != CURLE_OK) {
    const std::string why = error[0] ? error : curl_easy_strerror(rc);
    switch (rc) {
    case CURLE_PEER_FAILED_VERIFICATION:
      throw ConfigError(where + ": its certificate does not verify (" + why +
                        "); name the CA that signed it (--etcd-cacert or FLOTILLA_ETCD_CACERT) "
                        "and check that the certificate names this host");
    case CURLE_SSL_CACERT_BADFILE:
    case CURLE_SSL_CERTPROBLEM:
      throw ConfigError(where + ": cannot use the certificates given (" + why +
                        "); check --etcd-cacert, --etcd-cert and --etcd-key (or FLOTILLA_ETCD_"
                        "CACERT, _CERT, _KEY): PEM files, the key the certificate's own");
    case CURLE_WRITE_ERROR:
      throw CommError(where + ": an answer over 1 MiB");
    case CURLE_SSL_CONNECT_ERROR:
    case CURLE_SEND_ERROR:
    case CURLE_RECV_ERROR:
    case CURLE_GOT_NOTHING:
      diagnose(to, why); // a ConfigError where etcd refused this client's TLS or lack of it
      break;
    default:
      break;
    }
    throw CommError(why);
  }
  long status = 0;
  curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, &status);
  if (status != 200) {
    std::string message = answer;
    try {
      message = message_of(json::parse(answer));
    } catch (const json::exception&) {
    }
    refused(etcd_, where + " (HTTP " + std::to_string(status) + ")", message);
  }
  return answer;
}

std::string EtcdClient::post(Endpoint& to, const std::string& path, const std::string& body) {
  if (etcd_.user.empty()) return exchange(to, path, body, "");
  const auto authenticate = [&] {
    const json j = parse(exchange(to, "/v3/auth/authenticate",
                                  json{{"name", etcd_.user}, {"password", etcd_.password}}.dump(),
                                  ""));
    token_ = j.value("token", "");
    if (token_.empty()) {
      throw ConfigError("etcd at " + to.base + " issued no token for the user " +
                        echoed(etcd_.user, 80) + ": is its authentication enabled (etcdctl auth "
                        "enable)?");
    }
  };
  if (token_.empty()) authenticate();
  try {
    return exchange(to, path, body, token_);
  } catch (const ExpiredToken&) {
    authenticate();
    return exchange(to, path, body, token_);
  }
}

nlohmann::json EtcdClient::post_to(std::size_t at, const std::string& path,
                                   const std::string& body) {
  Endpoint& to = *endpoints_[at];
  json j = parse(post(to, path, body));
  // A gRPC error in JSON (e.g. a member without its cluster's quorum; a streaming call's error
  // comes inside an answer of status 200).
  if (j.contains("error") || (j.contains("code") && !j.contains("header"))) {
    refused(etcd_, "etcd at " + to.base, message_of(j));
  }
  return j;
}

nlohmann::json EtcdClient::call(const std::string& path, const std::string& body) {
  std::lock_guard<std::mutex> lock(mutex_);
  std::string failures;
  bool refused_us = false; // an endpoint refused this client's credentials
  for (std::size_t i = 0; i < endpoints_.size(); ++i) {
    const std::size_t at = (next_ + i) % endpoints_.size();
    try {
      json answer = post_to(at, path, body);
      next_ = at;
      return answer;
    } catch (const ConfigError& e) {
      refused_us = true;
      failures += (failures.empty() ? "" : "; ") + std::string(e.what());
    } catch (const CommError& e) {
      failures += (failures.empty() ? "" : "; ") + endpoints_[at]->address.to_string() + ": " +
                  e.what();
    }
  }
  next_ = (next_ + 1) % endpoints_.size();
  // Where no endpoint answered and one refused: waiting cannot help, so not a CommError.
  if (refused_us) throw ConfigError("etcd refused " + path + ": " + failures);
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
