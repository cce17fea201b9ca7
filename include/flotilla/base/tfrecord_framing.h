// TFRecord framing, written and read in one place: a record's length (8 bytes little-endian),
// the masked CRC-32C of the length, the data, the masked CRC-32C of the data. TFRecord files
// (data) and TensorBoard event files (train) both use it. Without LibTorch, so that the checks on
// untrusted input can be fuzzed on their own (tests/fuzz).
#pragma once

#include <istream>
#include <optional>
#include <string>
#include <string_view>

namespace flotilla::base {

// `data` as one framed record, ready to append to a file.
std::string frame_tfrecord(std::string_view data);

// The next record's data, or nullopt at a clean end of the stream. DataError, starting with
// `where` (e.g. "file.tfrecord: record 3"), on a short stream or a CRC mismatch. Memory grows
// with the bytes actually read, never with the length the header merely claims.
std::optional<std::string> read_tfrecord(std::istream& in, const std::string& where);

} // namespace flotilla::base
