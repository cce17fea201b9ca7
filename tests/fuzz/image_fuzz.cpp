// An image file from an image folder, decoded by libjpeg or libpng as image_dataset_from_directory
// decodes it, as grey and as RGB. A DataError is the only refusal; what decodes has the channels
// asked for and exactly their pixels. Inputs claiming more than 2^28 pixels must be refused
// before anything that size is allocated (libFuzzer's -rss_limit_mb catches it otherwise).
#include "data/image_decode.h"
#include "tests/fuzz/fuzz_support.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace flotilla::data::detail;
  const std::string bytes(flotilla::fuzz::as_text(data, size));
  for (const bool grey : {true, false}) {
    flotilla::fuzz::expect_only_flotilla_errors([&] {
      const Pixels p = decode_image_bytes(bytes, "fuzz.img", grey);
      if (p.channels != (grey ? 1 : 3) || p.height <= 0 || p.width <= 0 ||
          p.chw.size() != static_cast<std::size_t>(p.channels * p.height * p.width)) {
        __builtin_trap();
      }
    });
  }
  return 0;
}
