// What every fuzz target shares: run one parse and let only flotilla's own errors through.
// A parser may refuse any input, but only with a flotilla::Error subclass; any other exception
// escapes to libFuzzer, which reports it (std::terminate) as a crash with the input saved.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "flotilla/error.h"

namespace flotilla::fuzz {

template <class F> void expect_only_flotilla_errors(F&& parse) {
  try {
    parse();
  } catch (const flotilla::Error&) {
    // Refusing bad input with a message is the parser's job.
  }
}

inline std::string_view as_text(const std::uint8_t* data, std::size_t size) {
  return {reinterpret_cast<const char*>(data), size};
}

} // namespace flotilla::fuzz
