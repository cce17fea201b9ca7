// Private: TFRecord framing (length, masked CRC-32C of the length, data, masked CRC-32C of the
// data) read from a stream, without LibTorch, so that the checks on untrusted input can be
// fuzzed on their own (tests/fuzz). TFRecordReader reads files with it.
#pragma once

#include <istream>
#include <optional>
#include <string>

namespace flotilla::data::detail {

// The next record's data, or nullopt at a clean end of the stream. DataError, starting with
// `where` (e.g. "file.tfrecord: record 3"), on a short stream or a CRC mismatch. Memory grows
// with the bytes actually read, never with the length the header merely claims.
std::optional<std::string> read_tfrecord(std::istream& in, const std::string& where);

} // namespace flotilla::data::detail
