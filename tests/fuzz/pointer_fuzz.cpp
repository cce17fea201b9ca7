// The checkpoint pointer file (TensorFlow's CheckpointState in protobuf text format), as
// restore_latest reads it from a checkpoint directory anyone with write access may have edited.
// A CheckpointError is the only refusal; what parses must survive its own round trip.
#include "flotilla/checkpoint/pointer.h"
#include "tests/fuzz/fuzz_support.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace flotilla::checkpoint;
  flotilla::fuzz::expect_only_flotilla_errors([&] {
    const CheckpointPointer pointer =
        parse_pointer(std::string(flotilla::fuzz::as_text(data, size)), "/ckpt/checkpoint");
    const CheckpointPointer again = parse_pointer(format_pointer(pointer), "/ckpt/checkpoint");
    if (again.model_checkpoint_path != pointer.model_checkpoint_path ||
        again.all_model_checkpoint_paths != pointer.all_model_checkpoint_paths) {
      __builtin_trap(); // format_pointer wrote what parse_pointer reads otherwise
    }
  });
  return 0;
}
