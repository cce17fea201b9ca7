// How each operation asks which implementation runs (choice.h): a key naming the shape, and the
// two candidates' runs, built only when there is something to time.
#pragma once

#include <functional>
#include <string>

namespace flotilla::kernels::detail {

// One run of each candidate on inputs of the key's shape: forward, and backward where the key is
// a training one. Built once, run several times.
struct Candidates {
  std::function<void()> flotilla;
  std::function<void()> aten;
};

// Whether flotilla's kernel runs operation `op` at `key` (the shape, type and layout; this adds
// the thread count and whether a gradient is wanted). Mode::kFixed: yes; kNone: no; kMeasure:
// what this process or the cache decided, or else what timing make()'s candidates decides now
// (under the cache's lock, recorded there). Call it only where flotilla's kernel applies.
bool use_flotilla(const char* op, const std::string& key, bool training,
                  const std::function<Candidates()>& make);

// The key's text for a shape: "64x128x14x14".
std::string shape_text(const std::vector<std::int64_t>& sizes);

} // namespace flotilla::kernels::detail
