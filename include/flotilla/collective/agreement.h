// Cross-worker agreements: the questions every worker must answer the same way before it acts
// ("did every worker succeed?", "does any worker want to stop?", "do all hold the same value?").
// Each is one small collective, so every rank must ask it at the same point of its program, in
// the same order as the others, as with any collective; the answer is then the same on every
// rank. With one rank they answer at once, sending nothing.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "flotilla/collective/communicator.h"

namespace flotilla::collective {

// Every rank's flag and value, folded.
struct Agreement {
  bool all = true;      // every rank's flag was true
  bool any = true;      // at least one rank's flag was true
  std::int64_t min = 0; // the smallest and the largest of the values
  std::int64_t max = 0;
  bool same() const { return min == max; }
};

// One MIN all-reduce of four integers (flag, -flag, value, -value).
Agreement agree(Communicator& comm, bool flag, std::int64_t value = 0);
inline bool all_true(Communicator& comm, bool flag) {
  return agree(comm, flag).all;
}
inline bool any_true(Communicator& comm, bool flag) {
  return agree(comm, flag).any;
}
inline bool same_value(Communicator& comm, std::int64_t value) {
  return agree(comm, true, value).same();
}

// agree(), started now and answered later, so the collective overlaps other work (a step).
class PendingAgreement {
 public:
  PendingAgreement(Communicator& comm, bool flag, std::int64_t value = 0);
  // Blocks until every rank has answered; call it once.
  Agreement wait();

 private:
  at::Tensor values_;
  Work work_;
  bool alone_ = false;
};

// Every rank's one-dimensional `mine`, in rank order, on every rank (on the CPU), where the
// lengths may differ between ranks (the dtype may not): two all-gathers, the lengths and then
// the tensors padded to the longest.
std::vector<at::Tensor> all_gather_uneven(Communicator& comm, const at::Tensor& mine);
// The same for text (the start-up check's fields, ...).
std::vector<std::string> all_gather_strings(Communicator& comm, const std::string& mine);
// Rank `root`'s bytes, on every rank (two broadcasts: the length, then the bytes); `mine` is
// read on the root only.
std::string broadcast_string(Communicator& comm, const std::string& mine, int root);

// Messages between members checked under the group's cluster token (CommunicationOptions::
// cluster_token). seal() appends an HMAC-SHA256 of `message`, keyed by the token and bound to
// `purpose`; open_sealed() checks and strips it: nullopt when it does not match (the message
// changed on the way, or was sealed by a process without the token) or is too short to hold it.
// Without a token both pass the message as it is: there is no key (and the rendezvous admits
// anyone then).
std::string seal(const std::optional<std::string>& token, const std::string& purpose,
                 std::string message);
std::optional<std::string> open_sealed(const std::optional<std::string>& token,
                                       const std::string& purpose, std::string sealed);

} // namespace flotilla::collective
