// What the members and the rendezvous tell each other beyond the store's own operations, the part
// of the control plane's protocol the data plane reads and writes (collective::ElasticGroup): the
// heartbeat's answer (Pong) and the reports members leave in the store, under their keys. The
// bytes around them (framing, handshake, bounds) are the rendezvous module's own (src/rendezvous/
// wire.h).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace flotilla::collective::detail {

// The server's answer to a heartbeat's ping: the failed ranks, each with its reason. In elastic
// mode (see RendezvousServer) also the membership's news: the newest generation, the oldest
// generation no member has left since (a rank in an older one must regroup), how many
// restarted workers wait to be admitted, and whether this rank was expelled; `failed` then holds
// the last departure, whose reason the survivors' errors quote.
struct Pong {
  bool closing = false; // the chief is leaving normally
  std::vector<std::pair<std::int32_t, std::string>> failed;
  std::uint64_t generation = 0;
  std::uint64_t intact_from = 0;
  std::uint32_t waiting = 0;
  bool expelled = false;

  std::string frame() const;
  // WireError when malformed or naming more than `world_size` failed ranks.
  static Pong parse(const std::string& body, int world_size);
};

// Store values the server reads as well as stores.

// "a,b,c": the slot lists of generation records and the ranks of silent reports.
std::string int_list(const std::vector<int>& values);
// nullopt unless `text` is empty or non-negative decimal integers (at most 9 digits each)
// separated by commas.
std::optional<std::vector<int>> parse_int_list(const std::string& text);

// A member's report (key kSilentPrefix + its rank, under its generation's prefix "flotilla/g<N>/")
// that `ranks` of its generation never reached the collective it timed out in:
// "<sequence> <rank>,<rank>,... <description>". An elastic rendezvous expels them.
inline const std::string kSilentPrefix = "flotilla/silent/";
// Its report, after a collective failed and no member left, of the ranks it could not reach
// with a probe (maybe none; key kUnreachablePrefix + its rank, under the generation's prefix;
// the same text, sequence 0): the rendezvous expels the smaller side of a partition.
inline const std::string kUnreachablePrefix = "flotilla/unreachable/";
// Where a member answers probes ("host:port"; key kProbePrefix + its rank, likewise).
inline const std::string kProbePrefix = "flotilla/probe/";
struct SilentReport {
  std::uint64_t sequence = 0;
  std::vector<int> ranks;
  std::string description;

  std::string text() const;
  // nullopt when `text` is not such a report.
  static std::optional<SilentReport> parse(const std::string& text);
};

} // namespace flotilla::collective::detail
