#include "flotilla/collective/agreement.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/tensor.h>
#include <ATen/ops/zeros.h>

#include <openssl/crypto.h>

#include <algorithm>

#include "flotilla/base/hashes.h"

namespace flotilla::collective {
namespace {

at::Tensor encode(bool flag, std::int64_t value) {
  const std::int64_t f = flag ? 1 : 0;
  return at::tensor({f, -f, value, -value}, at::kLong);
}

Agreement decode(const at::Tensor& folded) {
  const auto* v = folded.data_ptr<std::int64_t>();
  return Agreement{v[0] == 1, v[1] == -1, v[2], -v[3]};
}

} // namespace

Agreement agree(Communicator& comm, bool flag, std::int64_t value) {
  return PendingAgreement(comm, flag, value).wait();
}

PendingAgreement::PendingAgreement(Communicator& comm, bool flag, std::int64_t value)
    : values_(encode(flag, value)), alone_(comm.size() == 1) {
  if (!alone_) work_ = comm.all_reduce(values_, ReduceOp::kMin);
}

Agreement PendingAgreement::wait() {
  if (!alone_) work_.wait();
  return decode(values_);
}

std::vector<at::Tensor> all_gather_uneven(Communicator& comm, const at::Tensor& mine) {
  const at::Tensor flat = mine.reshape({-1});
  if (comm.size() == 1) return {flat.cpu()};
  Work lengths = comm.all_gather(at::tensor({flat.numel()}, at::kLong));
  lengths.wait();
  std::int64_t longest = 0;
  for (const auto& l : lengths.result()) longest = std::max(longest, l.item<std::int64_t>());
  const at::Tensor padded = at::zeros({longest}, flat.options());
  padded.narrow(0, 0, flat.numel()).copy_(flat);
  Work all = comm.all_gather(padded);
  all.wait();
  std::vector<at::Tensor> out;
  for (std::size_t r = 0; r < all.result().size(); ++r) {
    out.push_back(
        all.result()[r].narrow(0, 0, lengths.result()[r].item<std::int64_t>()).cpu().contiguous());
  }
  return out;
}

std::vector<std::string> all_gather_strings(Communicator& comm, const std::string& mine) {
  at::Tensor bytes = at::empty({static_cast<std::int64_t>(mine.size())}, at::kByte);
  std::copy(mine.begin(), mine.end(), bytes.data_ptr<std::uint8_t>());
  std::vector<std::string> out;
  for (const auto& t : all_gather_uneven(comm, bytes)) {
    const auto* begin = t.data_ptr<std::uint8_t>();
    out.emplace_back(begin, begin + t.numel());
  }
  return out;
}

namespace {
constexpr std::size_t kMacBytes = 32;

// The HMAC of the first `length` bytes of `message` (one copy of them, with the header).
std::string mac_of(const std::string& token, const std::string& purpose,
                   const std::string& message, std::size_t length) {
  std::string input = "flotilla sealed v1\n" + purpose + "\n";
  input.append(message, 0, length);
  const auto mac = base::hmac_sha256(token, input);
  return std::string(mac.begin(), mac.end());
}
} // namespace

std::string seal(const std::optional<std::string>& token, const std::string& purpose,
                 std::string message) {
  if (!token) return message;
  const std::size_t length = message.size();
  message += mac_of(*token, purpose, message, length);
  return message;
}

std::optional<std::string> open_sealed(const std::optional<std::string>& token,
                                       const std::string& purpose, std::string sealed) {
  if (!token) return sealed;
  if (sealed.size() < kMacBytes) return std::nullopt;
  const std::size_t length = sealed.size() - kMacBytes;
  const std::string expected = mac_of(*token, purpose, sealed, length);
  if (CRYPTO_memcmp(expected.data(), sealed.data() + length, kMacBytes) != 0) return std::nullopt;
  sealed.resize(length);
  return sealed;
}

std::string broadcast_string(Communicator& comm, const std::string& mine, int root) {
  if (comm.size() == 1) return mine;
  at::Tensor length = at::tensor({static_cast<std::int64_t>(mine.size())}, at::kLong);
  comm.broadcast(length, root).wait();
  const std::int64_t n = length.item<std::int64_t>();
  at::Tensor bytes = at::empty({n}, at::kByte);
  if (comm.rank() == root) std::copy(mine.begin(), mine.end(), bytes.data_ptr<std::uint8_t>());
  comm.broadcast(bytes, root).wait();
  if (comm.rank() == root) return mine;
  const auto* begin = bytes.data_ptr<std::uint8_t>();
  return std::string(begin, begin + n);
}

} // namespace flotilla::collective
