// CRC-32C (Castagnoli), as TFRecord frames and TensorBoard event files use it, with
// TensorFlow's masking.
#pragma once

#include <cstddef>
#include <cstdint>

namespace flotilla::base {

std::uint32_t crc32c(const void* data, std::size_t size, std::uint32_t crc = 0);
// TFRecord stores masked CRCs: a CRC of data that itself holds CRCs is then not trivially zero.
inline std::uint32_t mask_crc(std::uint32_t crc) {
  return ((crc >> 15) | (crc << 17)) + 0xa282ead8u;
}

} // namespace flotilla::base
