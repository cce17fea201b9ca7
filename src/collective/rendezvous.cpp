#include "collective/rendezvous.h"

#include "collective/wire.h"

namespace flotilla::collective::detail {

std::string RendezvousConfig::name(int r) const {
  if (r >= 0 && static_cast<std::size_t>(r) < names.size()) return names[r];
  return "rank " + std::to_string(r);
}

std::string RendezvousConfig::server_name() const {
  if (!external) return name(0) + ", which hosts the rendezvous,";
  return "the rendezvous at " + (locate ? locate_name : chief.to_string());
}

std::array<std::uint8_t, 16> new_session() {
  return random_bytes<16>();
}

std::string ms_text(std::chrono::milliseconds d) {
  const auto ms = d.count();
  return ms % 1000 == 0 ? std::to_string(ms / 1000) + " s" : std::to_string(ms) + " ms";
}

} // namespace flotilla::collective::detail
