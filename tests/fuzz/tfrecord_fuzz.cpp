// TFRecord files and the tf.train.Example records inside them. The first byte picks the parser,
// because a mutated record rarely keeps valid CRCs: even, the rest is a TFRecord stream (each
// record that passes its CRCs is decoded as an Example, as tfrecord_dataset with a spec does);
// odd, the rest is one serialized Example.
#include <map>
#include <sstream>

#include "data/example_codec.h"
#include "flotilla/base/tfrecord_framing.h"
#include "tests/fuzz/fuzz_support.h"

using namespace flotilla::data::detail;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size == 0) return 0;
  const std::string rest(reinterpret_cast<const char*>(data) + 1, size - 1);
  std::map<std::string, FeatureValues> features;
  if (data[0] % 2 == 1) {
    decode_example(rest, features); // refuses with false; must not throw or crash
    return 0;
  }
  std::istringstream in(rest);
  flotilla::fuzz::expect_only_flotilla_errors([&] {
    for (int index = 0; auto record = flotilla::base::read_tfrecord(in, "fuzz.tfrecord: record " +
                                                                            std::to_string(index));
         ++index) {
      decode_example(*record, features);
    }
  });
  return 0;
}
