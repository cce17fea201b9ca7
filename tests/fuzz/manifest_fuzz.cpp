// A checkpoint's manifest.json, with the rules read_checkpoint applies.
#include "checkpoint/manifest.h"
#include "tests/fuzz/fuzz_support.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  // The names read_checkpoint passes (checkpoint_manager.h; not included: it needs LibTorch).
  static const flotilla::checkpoint::detail::ManifestRules rules{
      "flotilla-checkpoint", 1, {"model.safetensors", "optimizer.safetensors"}};
  flotilla::fuzz::expect_only_flotilla_errors([&] {
    flotilla::checkpoint::detail::parse_manifest(flotilla::fuzz::as_text(data, size),
                                                 "/ckpt/ckpt-1/manifest.json", rules);
  });
  return 0;
}
