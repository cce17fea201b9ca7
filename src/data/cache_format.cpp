#include "data/cache_format.h"

#include <fstream>

#include "flotilla/error.h"

namespace flotilla::data::detail {

CacheReader::CacheReader(std::unique_ptr<std::istream> in, std::uint64_t size, std::string path,
                         CacheElementSize element_size)
    : in_(std::move(in)), left_(size), path_(std::move(path)), element_size_(element_size) {}

CacheReader CacheReader::open(const std::string& path, CacheElementSize element_size) {
  auto in = std::make_unique<std::ifstream>(path, std::ios::binary | std::ios::ate);
  const std::uint64_t size = *in ? static_cast<std::uint64_t>(in->tellg()) : 0;
  in->seekg(0);
  return CacheReader(std::move(in), size, path, element_size);
}

void CacheReader::ends_early() const {
  throw DataError("cache file " + path_ + " ends early; delete it to rebuild it");
}

void CacheReader::read_into(void* out, std::size_t n) {
  if (n > left_) ends_early();
  in_->read(static_cast<char*>(out), static_cast<std::streamsize>(n));
  if (!*in_) ends_early();
  left_ -= n;
}

std::string CacheReader::fingerprint() {
  std::string magic(sizeof(kCacheMagic) - 1, '\0');
  read_into(magic.data(), magic.size());
  if (magic != kCacheMagic) {
    throw DataError("cache file " + path_ +
                    " is not a flotilla cache (it starts with something "
                    "else); remove it or choose another cache filename");
  }
  const auto length = read<std::uint64_t>();
  if (length > left_) ends_early();
  std::string out(static_cast<std::size_t>(length), '\0');
  read_into(out.data(), out.size());
  return out;
}

std::optional<std::uint32_t> CacheReader::next_arity() {
  const auto arity = read<std::uint32_t>();
  if (arity == kCacheCountMarker) return std::nullopt;
  return arity;
}

CacheTensorHeader CacheReader::tensor_header() {
  const auto corrupt = [&](const std::string& what) {
    return DataError("cache file " + path_ + " is corrupt (" + what + "); delete it to rebuild it");
  };
  CacheTensorHeader h;
  h.dtype = read<std::int8_t>();
  const std::size_t element = element_size_(h.dtype);
  if (element == 0) throw corrupt("dtype code " + std::to_string(h.dtype));
  const auto ndim = read<std::uint8_t>();
  if (ndim > 16) throw corrupt(std::to_string(ndim) + " dimensions");
  h.dims.resize(ndim);
  std::uint64_t numel = 1;
  const std::uint64_t limit = left_; // no tensor holds more elements than bytes left
  for (auto& d : h.dims) {
    d = read<std::int64_t>();
    if (d < 0 || (d > 0 && numel > limit / static_cast<std::uint64_t>(d))) {
      throw corrupt("a dimension of " + std::to_string(d));
    }
    numel *= static_cast<std::uint64_t>(d);
  }
  h.bytes = read<std::uint64_t>();
  if (numel > limit || h.bytes != numel * element) {
    throw corrupt("a tensor's size does not match its shape");
  }
  if (h.bytes > left_) throw corrupt("a tensor runs past the end of the file");
  return h;
}

std::string cached_fingerprint(const std::string& path) {
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  if (!in) return "";
  const auto size = static_cast<std::int64_t>(in.tellg());
  const std::int64_t magic = sizeof(kCacheMagic) - 1;
  const std::int64_t end = sizeof(kCacheEnd) - 1;
  if (size < magic + 8 + 8 + end) return "";
  std::string tail(static_cast<std::size_t>(end), '\0');
  in.seekg(size - end);
  in.read(tail.data(), end);
  in.seekg(0);
  std::string head(static_cast<std::size_t>(magic), '\0');
  in.read(head.data(), magic);
  std::uint64_t length = 0;
  in.read(reinterpret_cast<char*>(&length), 8);
  if (!in || head != kCacheMagic || tail != kCacheEnd ||
      length > static_cast<std::uint64_t>(size)) {
    return "";
  }
  std::string fingerprint(length, '\0');
  in.read(fingerprint.data(), static_cast<std::streamsize>(length));
  return in ? fingerprint : "";
}

} // namespace flotilla::data::detail
