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

// What goes around a record's data: write header, the data itself, then footer (no copy of
// the data is made).
struct TFRecordFrame {
  char header[12]; // the length and its masked CRC-32C
  char footer[4];  // the data's masked CRC-32C
};
TFRecordFrame tfrecord_frame(std::string_view data);
// `data` framed, appended to `out`.
void append_tfrecord(std::string& out, std::string_view data);

// The next record's data, or nullopt at a clean end of the stream. DataError, starting with
// `where` (e.g. "file.tfrecord: record 3"), on a short stream or a CRC mismatch. Memory grows
// with the bytes actually read, never with the length the header merely claims.
std::optional<std::string> read_tfrecord(std::istream& in, const std::string& where);

} // namespace flotilla::base
