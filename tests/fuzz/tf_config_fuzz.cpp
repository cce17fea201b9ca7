// TF_CONFIG as a worker receives it from its environment.
#include "flotilla/cluster/cluster_spec.h"
#include "tests/fuzz/fuzz_support.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  flotilla::fuzz::expect_only_flotilla_errors([&] {
    const auto spec = flotilla::cluster::parse_tf_config(flotilla::fuzz::as_text(data, size));
    // What was accepted must print back as TF_CONFIG (flotilla tf-config, flotilla launch).
    flotilla::cluster::parse_tf_config(flotilla::cluster::to_tf_config(spec));
  });
  return 0;
}
