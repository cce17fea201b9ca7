// The checkpoint pointer file ("checkpoint" in a checkpoint directory): TensorFlow's
// CheckpointState in protobuf text format, which tf.train.latest_checkpoint reads. Text only,
// no LibTorch, so it can be fuzzed on its own.
#pragma once

#include <string>
#include <vector>

namespace flotilla::checkpoint {

// The pointer file's contents; paths are as written (relative to the directory unless absolute).
struct CheckpointPointer {
  std::string model_checkpoint_path;
  std::vector<std::string> all_model_checkpoint_paths; // oldest first
};

// `text` as a pointer file; `file` names it in errors. CheckpointError (naming the line) for a
// line that is not "field: value", a path that is not a quoted string or has a bad escape, or no
// model_checkpoint_path. Other fields (TensorFlow's timestamps) are skipped.
CheckpointPointer parse_pointer(const std::string& text, const std::string& file);
// What parse_pointer reads back as `pointer`, byte for byte (protobuf's C escapes).
std::string format_pointer(const CheckpointPointer& pointer);

} // namespace flotilla::checkpoint
