// A Dataset::cache(filename) file, read back as the replay pass reads it: the file may be damaged
// or written by someone else into a shared directory. A DataError is the only refusal; no tensor
// may claim more bytes than are left, so what is allocated is bounded by the file's size.
#include <sstream>

#include "data/cache_format.h"
#include "tests/fuzz/fuzz_support.h"

namespace {

// LibTorch's codes for the dtypes a pipeline caches (uint8 .. float64, bool, bfloat16).
std::size_t element_size(std::int8_t code) {
  switch (code) {
  case 0:
  case 1:
  case 11:
    return 1;
  case 2:
  case 5:
  case 15:
    return 2;
  case 3:
  case 6:
    return 4;
  case 4:
  case 7:
    return 8;
  default:
    return 0;
  }
}

} // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace flotilla::data::detail;
  flotilla::fuzz::expect_only_flotilla_errors([&] {
    CacheReader reader(
        std::make_unique<std::istringstream>(std::string(flotilla::fuzz::as_text(data, size))),
        size, "fuzz.flotilla-cache", element_size);
    const std::string fingerprint = reader.fingerprint();
    std::uint64_t allocated = fingerprint.size();
    while (const auto arity = reader.next_arity()) {
      for (std::uint32_t i = 0; i < *arity; ++i) {
        const CacheTensorHeader h = reader.tensor_header();
        std::uint64_t numel = 1;
        for (const auto d : h.dims) numel *= static_cast<std::uint64_t>(d);
        if (h.bytes != numel * element_size(h.dtype)) __builtin_trap();
        allocated += h.bytes;
        if (allocated > size) __builtin_trap(); // more than the file holds
        std::string tensor(static_cast<std::size_t>(h.bytes), '\0');
        reader.read_into(tensor.data(), tensor.size());
      }
    }
  });
  return 0;
}
