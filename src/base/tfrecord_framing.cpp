#include "flotilla/base/tfrecord_framing.h"

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>

#include "flotilla/base/crc32c.h"
#include "flotilla/error.h"

namespace flotilla::base {
namespace {

std::string hex(std::uint32_t v) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "0x%08x", v);
  return buf;
}

} // namespace

TFRecordFrame tfrecord_frame(std::string_view data) {
  TFRecordFrame frame;
  const std::uint64_t length = data.size();
  std::memcpy(frame.header, &length, 8);
  const std::uint32_t length_crc = mask_crc(crc32c(frame.header, 8));
  std::memcpy(frame.header + 8, &length_crc, 4);
  const std::uint32_t data_crc = mask_crc(crc32c(data.data(), data.size()));
  std::memcpy(frame.footer, &data_crc, 4);
  return frame;
}

void append_tfrecord(std::string& out, std::string_view data) {
  const TFRecordFrame frame = tfrecord_frame(data);
  out.append(frame.header, sizeof frame.header);
  out.append(data);
  out.append(frame.footer, sizeof frame.footer);
}

std::optional<std::string> read_tfrecord(std::istream& in, const std::string& where) {
  unsigned char header[12];
  in.read(reinterpret_cast<char*>(header), 12);
  const auto got = in.gcount();
  if (got == 0) return std::nullopt;
  if (got < 12) {
    throw DataError(where + ": truncated: the file ends inside the record's 12-byte header");
  }
  std::uint64_t length = 0;
  std::uint32_t length_crc = 0;
  std::memcpy(&length, header, 8);
  std::memcpy(&length_crc, header + 8, 4);
  const std::uint32_t expected_length_crc = mask_crc(crc32c(header, 8));
  if (length_crc != expected_length_crc) {
    throw DataError(where + ": length CRC mismatch (stored " + hex(length_crc) + ", computed " +
                    hex(expected_length_crc) + "); the file is corrupt or not a TFRecord file");
  }
  // The length is checked by its CRC but can still be anything up to 2^64 (a crafted file, or
  // one written wrongly): grow the buffer with what arrives, at most doubling, instead of
  // allocating what the header claims.
  constexpr std::uint64_t kFirstChunk = std::uint64_t{1} << 20;
  std::string data;
  std::uint64_t held = 0;
  while (held < length) {
    const std::uint64_t want = std::min(length, std::max(kFirstChunk, 2 * held));
    data.resize(static_cast<std::size_t>(want));
    in.read(data.data() + held, static_cast<std::streamsize>(want - held));
    held += static_cast<std::uint64_t>(in.gcount());
    if (held < want) break;
  }
  std::uint32_t data_crc = 0;
  if (held != length || !in.read(reinterpret_cast<char*>(&data_crc), 4)) {
    throw DataError(where + ": truncated: the record claims " + std::to_string(length) +
                    " bytes and its CRC, the file ends first");
  }
  const std::uint32_t expected = mask_crc(crc32c(data.data(), data.size()));
  if (data_crc != expected) {
    throw DataError(where + ": data CRC mismatch (stored " + hex(data_crc) + ", computed " +
                    hex(expected) + "); the file is corrupt");
  }
  return data;
}

} // namespace flotilla::base
