// How the gradient engine packs gradients into buckets, as one torch-free function that the
// engine (GradientReducer) and the scaling planner (profile/planner.h) both call, so a predicted
// plan is the plan the engine makes (c10d's compute_bucket_assignment_by_size plays this part
// for PyTorch's reducer).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace flotilla::strategy {

// One parameter's gradient: its size in bytes and its kind, the dtype and device it lives in
// ("Float@cpu"); a bucket holds one kind only, since it is one flat tensor.
struct GradientSlot {
  std::int64_t bytes = 0;
  std::string kind;
};

// Parameters in the order backward produces their gradients (reverse registration order), packed
// in that order: a bucket is closed before a parameter of another kind, or before one that would
// take it past `bytes_per_pack` (a parameter larger than that gets a bucket of its own; a bucket
// never splits a parameter). Returns each bucket's indices into `slots`, in order. ConfigError
// when bytes_per_pack < 1.
std::vector<std::vector<std::size_t>> assign_buckets(const std::vector<GradientSlot>& slots,
                                                     std::int64_t bytes_per_pack);

} // namespace flotilla::strategy
