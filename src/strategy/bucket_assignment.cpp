#include "flotilla/strategy/bucket_assignment.h"

#include "flotilla/error.h"

namespace flotilla::strategy {

std::vector<std::vector<std::size_t>> assign_buckets(const std::vector<GradientSlot>& slots,
                                                     std::int64_t bytes_per_pack) {
  if (bytes_per_pack < 1) {
    throw ConfigError("bytes_per_pack must be positive; saw " + std::to_string(bytes_per_pack) +
                      " (CommunicationOptions::bytes_per_pack)");
  }
  std::vector<std::vector<std::size_t>> buckets;
  std::int64_t filled = 0;
  for (std::size_t i = 0; i < slots.size(); ++i) {
    const bool open = !buckets.empty() && !buckets.back().empty();
    if (!open || slots[buckets.back().front()].kind != slots[i].kind ||
        filled + slots[i].bytes > bytes_per_pack) {
      buckets.emplace_back();
      filled = 0;
    }
    buckets.back().push_back(i);
    filled += slots[i].bytes;
  }
  return buckets;
}

} // namespace flotilla::strategy
