#include "flotilla/cluster/cluster_spec.h"

#include <algorithm>
#include <cctype>

#include "flotilla/error.h"

namespace flotilla::cluster {

std::string Address::to_string() const {
  const bool v6 = host.find(':') != std::string::npos;
  return (v6 ? "[" + host + "]" : host) + ":" + std::to_string(port);
}

Address parse_address(std::string_view text, const std::string& what) {
  const std::string seen = echoed(text);
  const std::string form = "; write \"host:port\", e.g. \"10.0.0.2:2222\"";
  std::string host;
  std::string_view port_text;
  if (!text.empty() && text.front() == '[') { // [ipv6]:port
    const auto close = text.find(']');
    if (close == std::string_view::npos) {
      throw ConfigError(what + ": " + seen + " opens '[' without ']'" + form);
    }
    host = std::string(text.substr(1, close - 1));
    if (close + 1 >= text.size() || text[close + 1] != ':') {
      throw ConfigError(what + ": " + seen + " has no port" + form);
    }
    port_text = text.substr(close + 2);
  } else {
    const auto colon = text.rfind(':');
    if (colon == std::string_view::npos) {
      throw ConfigError(what + ": " + seen + " has no port" + form);
    }
    host = std::string(text.substr(0, colon));
    port_text = text.substr(colon + 1);
    if (host.find(':') != std::string::npos) {
      throw ConfigError(what + ": " + seen +
                        " looks like an IPv6 address without brackets; write \"[" + host +
                        "]:" + std::string(port_text) + "\"");
    }
  }
  if (host.empty()) throw ConfigError(what + ": " + seen + " has an empty host" + form);
  // A DNS name has at most 253 characters, none of them blank or a control byte; so an address
  // flotilla echoes later stays short and printable.
  const bool printable_host =
      std::none_of(host.begin(), host.end(), [](char c) {
        const auto u = static_cast<unsigned char>(c);
        return u <= 0x20 || u == 0x7f;
      });
  if (host.size() > 253 || !printable_host) {
    throw ConfigError(what + ": the host in " + seen +
                      (host.size() > 253 ? " is longer than a DNS name's 253 characters"
                                         : " holds a blank or a control character") +
                      form);
  }
  if (port_text.empty()) throw ConfigError(what + ": " + seen + " has no port" + form);
  long port = 0;
  for (char c : port_text) {
    if (!std::isdigit(static_cast<unsigned char>(c)) || port > 65535) {
      port = -1;
      break;
    }
    port = port * 10 + (c - '0');
  }
  if (port < 1 || port > 65535) {
    throw ConfigError(what + ": port " + echoed(port_text, 20) + " in " + seen +
                      " is not a valid port; use a number from 1 to 65535");
  }
  return Address{host, static_cast<int>(port)};
}

std::string_view to_string(TaskType type) {
  switch (type) {
  case TaskType::kChief:
    return "chief";
  case TaskType::kWorker:
    return "worker";
  case TaskType::kEvaluator:
    return "evaluator";
  }
  return "?";
}

std::vector<Address> ClusterSpec::training_addresses() const {
  std::vector<Address> out = chief;
  out.insert(out.end(), worker.begin(), worker.end());
  return out;
}

std::string EtcdRendezvous::url() const {
  std::string out = tls ? "etcds://" : "etcd://";
  for (std::size_t i = 0; i < endpoints.size(); ++i) out += (i ? "," : "") + endpoints[i].to_string();
  return out + "/" + job;
}

EtcdRendezvous parse_etcd_rendezvous(std::string_view text, const std::string& what) {
  const std::string seen = echoed(text);
  const std::string form = "; write etcd://HOST:PORT,HOST:PORT,...[/JOB] (etcds:// for TLS), e.g. "
                           "etcds://10.0.0.1:2379,10.0.0.2:2379,10.0.0.3:2379/resnet";
  constexpr std::string_view plain = "etcd://", secure = "etcds://";
  EtcdRendezvous out;
  std::string_view scheme = plain;
  if (text.substr(0, secure.size()) == secure) {
    scheme = secure;
    out.tls = true;
  } else if (text.substr(0, plain.size()) != plain) {
    throw ConfigError(what + ": " + seen + " does not start with etcd:// or etcds://" + form);
  }
  std::string_view rest = text.substr(scheme.size());
  out.job = "flotilla";
  if (const auto slash = rest.find('/'); slash != std::string_view::npos) {
    out.job = std::string(rest.substr(slash + 1));
    rest = rest.substr(0, slash);
    const bool valid = !out.job.empty() && out.job.size() <= 64 &&
                       out.job.find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVW"
                                                 "XYZ0123456789._-") == std::string::npos;
    if (!valid) {
      throw ConfigError(what + ": the job " + echoed(out.job, 80) + " in " + seen +
                        " must be 1 to 64 letters, digits, '.', '_' or '-'" + form);
    }
  }
  while (!rest.empty()) {
    const auto comma = rest.find(',');
    out.endpoints.push_back(parse_address(rest.substr(0, comma), what + " (an etcd endpoint)"));
    if (comma == std::string_view::npos) break;
    rest = rest.substr(comma + 1);
    if (rest.empty()) throw ConfigError(what + ": " + seen + " ends with a comma" + form);
  }
  if (out.endpoints.empty()) throw ConfigError(what + ": " + seen + " names no endpoint" + form);
  return out;
}

} // namespace flotilla::cluster
