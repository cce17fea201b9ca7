// A safetensors file's header, as a checkpoint restore or an elastic state transfer reads it: the
// bytes come from a directory others may write or from the network. A CheckpointError is the only
// refusal; every entry that parses must lie inside the data section and be exactly as long as its
// shape needs, so the tensor it becomes is never read past the file.
#include "checkpoint/safetensors_header.h"
#include "tests/fuzz/fuzz_support.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace flotilla::checkpoint::detail;
  flotilla::fuzz::expect_only_flotilla_errors([&] {
    const SafetensorsHeader header =
        parse_safetensors_header(flotilla::fuzz::as_text(data, size), "fuzz.safetensors");
    const auto data_size = static_cast<std::int64_t>(size) - header.data_start;
    if (header.data_start < 8 || data_size < 0) __builtin_trap();
    for (const auto& e : header.entries) {
      std::int64_t numel = 1;
      for (const auto d : e.shape) {
        if (d < 0) __builtin_trap();
        numel *= d;
      }
      const auto element = static_cast<std::int64_t>(safetensors_element_size(e.dtype));
      if (element == 0 || e.begin < 0 || e.end < e.begin || e.end > data_size ||
          e.end - e.begin != numel * element) {
        __builtin_trap(); // parse_safetensors_header let through what it promises to refuse
      }
    }
  });
  return 0;
}
