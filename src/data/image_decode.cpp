// JPEG through libjpeg (libjpeg-turbo on Debian: islow DCT, fancy upsampling); PNG through
// libpng's simplified API.
#include "data/image_decode.h"

#include <fcntl.h>
#include <setjmp.h>
#include <sys/stat.h>
#include <unistd.h>
// jpeglib.h needs size_t and FILE declared first.
#include <cstdio>
#include <jpeglib.h>
// After jpeglib.h: the J_MESSAGE_CODE enum (JWRN_...).
#include <jerror.h>
#include <png.h>

#include <cerrno>
#include <cstring>

#include "flotilla/error.h"

namespace flotilla::data::detail {

// An image file is at most this big: the largest image decoded (kMaxPixels) compresses to far
// less, and a file that is not an image must not be read whole into memory.
constexpr std::int64_t kMaxImageFileBytes = std::int64_t{256} << 20;

// The whole file, which must be a regular file (a link to one is followed): a FIFO, a device
// (/dev/zero), a socket or a directory would block, never end or fill the memory.
std::string read_image_file(const std::string& path) {
  // O_NONBLOCK: opening a FIFO with no writer returns at once (then refused below).
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) {
    throw DataError(path + ": cannot open the image (" + std::strerror(errno) + ")");
  }
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    throw DataError(path + ": cannot read the image (" + std::strerror(errno) + ")");
  }
  if (!S_ISREG(st.st_mode)) {
    const char* kind = S_ISDIR(st.st_mode)                          ? "a directory"
                       : S_ISFIFO(st.st_mode)                       ? "a FIFO"
                       : S_ISCHR(st.st_mode) || S_ISBLK(st.st_mode) ? "a device"
                       : S_ISSOCK(st.st_mode)                       ? "a socket"
                                                                    : "not a regular file";
    throw DataError(path + ": " + kind +
                    ", not an image file; an image folder holds regular "
                    "files (or links to them)");
  }
  if (st.st_size > kMaxImageFileBytes) {
    throw DataError(path + ": " + std::to_string(st.st_size) + " bytes, over the " +
                    std::to_string(kMaxImageFileBytes >> 20) +
                    " MiB an image file may have; it is not an image flotilla can decode");
  }
  std::string bytes(static_cast<std::size_t>(st.st_size), '\0');
  std::size_t got = 0;
  while (got < bytes.size()) {
    const ssize_t n = ::read(fd, bytes.data() + got, bytes.size() - got);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) throw DataError(path + ": cannot read the image (" + std::strerror(errno) + ")");
    if (n == 0) break; // it shrank while being read: decoding says it is truncated
    got += static_cast<std::size_t>(n);
  }
  bytes.resize(got);
  return bytes;
}

namespace {

// libjpeg reports errors through a callback that must not return: longjmp back to the setjmp in
// the function that called it. Those functions hold no C++ object with a destructor.
struct JpegErrors {
  jpeg_error_mgr pub;
  jmp_buf jump;
  char message[JMSG_LENGTH_MAX];
};

extern "C" void jpeg_fail(j_common_ptr cinfo) {
  auto* errors = reinterpret_cast<JpegErrors*>(cinfo->err);
  (*cinfo->err->format_message)(cinfo, errors->message);
  longjmp(errors->jump, 1);
}

// A warning that the pixels are damaged (truncated data, a bad Huffman code, a lost restart
// marker) is an error: libjpeg would fill the rest with grey and go on. Harmless ones (extra
// bytes between markers, odd but valid headers) are not, as in Pillow and TensorFlow.
extern "C" void jpeg_warn(j_common_ptr cinfo, int level) {
  if (level >= 0) return;
  switch (cinfo->err->msg_code) {
  case JWRN_JPEG_EOF:
  case JWRN_HIT_MARKER:
  case JWRN_HUFF_BAD_CODE:
  case JWRN_ARITH_BAD_CODE:
  case JWRN_MUST_RESYNC:
  case JWRN_NOT_SEQUENTIAL:
    jpeg_fail(cinfo); // does not return
    return;
  default:
    return;
  }
}

struct Jpeg {
  jpeg_decompress_struct cinfo;
  JpegErrors errors;
};

// The header only: the size it claims is checked before jpeg_start allocates (a progressive
// JPEG's whole-image coefficient arrays are allocated there, 25 GB for a 65500x65500 claim).
bool jpeg_header(Jpeg* j, const unsigned char* data, unsigned long size, bool gray) {
  j->cinfo.err = jpeg_std_error(&j->errors.pub);
  j->errors.pub.error_exit = jpeg_fail;
  j->errors.pub.emit_message = jpeg_warn;
  j->errors.message[0] = '\0';
  if (setjmp(j->errors.jump)) return false;
  jpeg_create_decompress(&j->cinfo);
  jpeg_mem_src(&j->cinfo, data, size);
  jpeg_read_header(&j->cinfo, TRUE);
  j->cinfo.out_color_space = gray ? JCS_GRAYSCALE : JCS_RGB;
  j->cinfo.dct_method = JDCT_ISLOW;
  j->cinfo.do_fancy_upsampling = TRUE;
  return true;
}

bool jpeg_start(Jpeg* j) {
  if (setjmp(j->errors.jump)) return false;
  jpeg_start_decompress(&j->cinfo);
  return true;
}

bool jpeg_rows(Jpeg* j, unsigned char* out) {
  if (setjmp(j->errors.jump)) return false;
  const std::size_t stride = j->cinfo.output_width * j->cinfo.output_components;
  while (j->cinfo.output_scanline < j->cinfo.output_height) {
    JSAMPROW row = out + j->cinfo.output_scanline * stride;
    jpeg_read_scanlines(&j->cinfo, &row, 1);
  }
  jpeg_finish_decompress(&j->cinfo);
  return true;
}

// The first `take` of `stored` interleaved channels, as planes.
std::vector<std::uint8_t> planes(std::vector<std::uint8_t> hwc, std::int64_t pixels,
                                 std::int64_t stored, std::int64_t take) {
  if (stored == 1) return hwc;
  std::vector<std::uint8_t> out(static_cast<std::size_t>(pixels * take));
  for (std::int64_t c = 0; c < take; ++c) {
    const std::uint8_t* in = hwc.data() + c;
    std::uint8_t* plane = out.data() + c * pixels;
    for (std::int64_t k = 0; k < pixels; ++k, in += stored) plane[k] = *in;
  }
  return out;
}

// A header may claim any size: refuse more than 2^28 pixels (16384 x 16384) before allocating.
constexpr std::int64_t kMaxPixels = std::int64_t{1} << 28;

void check_size(std::int64_t height, std::int64_t width, const std::string& path) {
  if (height * width > kMaxPixels) {
    throw DataError(path + ": the image claims " + std::to_string(width) + "x" +
                    std::to_string(height) + " pixels, more than flotilla decodes (2^28)");
  }
}

Pixels decode_jpeg(const std::string& bytes, const std::string& path, bool grey) {
  Jpeg j{};
  std::vector<std::uint8_t> hwc;
  bool ok =
      jpeg_header(&j, reinterpret_cast<const unsigned char*>(bytes.data()), bytes.size(), grey);
  const auto destroy_and_throw = [&] {
    jpeg_destroy_decompress(&j.cinfo);
    throw;
  };
  if (ok) {
    try {
      check_size(j.cinfo.image_height, j.cinfo.image_width, path);
    } catch (...) {
      destroy_and_throw();
    }
    ok = jpeg_start(&j);
  }
  Pixels out;
  if (ok) {
    out.height = j.cinfo.output_height;
    out.width = j.cinfo.output_width;
    out.channels = j.cinfo.output_components;
    try {
      hwc.resize(static_cast<std::size_t>(out.height * out.width * out.channels));
    } catch (...) {
      destroy_and_throw();
    }
    ok = jpeg_rows(&j, hwc.data());
  }
  const std::string message = j.errors.message;
  jpeg_destroy_decompress(&j.cinfo);
  if (!ok) {
    throw DataError(path + ": corrupt, truncated or unsupported JPEG (libjpeg: " + message + ")");
  }
  out.chw = planes(std::move(hwc), out.height * out.width, out.channels, out.channels);
  return out;
}

// PNG through libpng's simplified API, read as 8-bit grey+alpha or RGBA (alpha never blended into
// the pixels: it is dropped, as TensorFlow and Pillow's convert do; 16-bit samples are taken as
// sRGB and scaled). Colour to grey is ITU-R 601-2 luma (Pillow's convert("L")), not libpng's
// linear-light conversion.
Pixels decode_png(const std::string& bytes, const std::string& path, bool grey) {
  png_image image{};
  image.version = PNG_IMAGE_VERSION;
  if (!png_image_begin_read_from_memory(&image, bytes.data(), bytes.size())) {
    const std::string message = image.message;
    png_image_free(&image);
    throw DataError(path + ": corrupt PNG (libpng: " + message + ")");
  }
  const bool colour = (image.format & PNG_FORMAT_FLAG_COLOR) != 0;
  const bool alpha = (image.format & PNG_FORMAT_FLAG_ALPHA) != 0; // an alpha channel or tRNS
  // Read as it is stored, with its alpha (if any) kept apart: libpng blends alpha into whatever
  // the buffer holds when the output has none. Grey from colour is done here, below.
  image.format = colour || !grey ? (alpha ? PNG_FORMAT_RGBA : PNG_FORMAT_RGB)
                                 : (alpha ? PNG_FORMAT_GA : PNG_FORMAT_GRAY);
  image.flags |= PNG_IMAGE_FLAG_16BIT_sRGB;
  Pixels out;
  out.height = image.height;
  out.width = image.width;
  const std::int64_t stored = PNG_IMAGE_SAMPLE_CHANNELS(image.format);
  std::vector<std::uint8_t> hwc;
  try {
    check_size(out.height, out.width, path);
    hwc.resize(static_cast<std::size_t>(out.height * out.width * stored));
  } catch (...) {
    png_image_free(&image);
    throw;
  }
  if (!png_image_finish_read(&image, nullptr, hwc.data(), 0, nullptr)) {
    const std::string message = image.message;
    png_image_free(&image);
    throw DataError(path + ": corrupt or truncated PNG (libpng: " + message + ")");
  }
  const std::int64_t pixels = out.height * out.width;
  if (!grey || !colour) {
    out.channels = grey ? 1 : 3;
    out.chw = planes(std::move(hwc), pixels, stored, out.channels);
    return out;
  }
  // L = (19595 R + 38470 G + 7471 B + 2^15) >> 16, Pillow's integer form of 0.299/0.587/0.114.
  out.channels = 1;
  out.chw.resize(static_cast<std::size_t>(pixels));
  const std::uint8_t* in = hwc.data();
  for (std::int64_t k = 0; k < pixels; ++k, in += stored) {
    out.chw[static_cast<std::size_t>(k)] = static_cast<std::uint8_t>(
        (19595u * in[0] + 38470u * in[1] + 7471u * in[2] + 0x8000u) >> 16);
  }
  return out;
}

} // namespace

Pixels decode_image_bytes(const std::string& bytes, const std::string& path, bool grey) {
  auto starts = [&](const char* magic, std::size_t n) {
    return bytes.size() >= n && std::memcmp(bytes.data(), magic, n) == 0;
  };
  if (starts("\xFF\xD8\xFF", 3)) return decode_jpeg(bytes, path, grey);
  if (starts("\x89PNG\r\n\x1A\n", 8)) return decode_png(bytes, path, grey);
  const char* kind = starts("GIF8", 4) ? "a GIF image" : starts("BM", 2) ? "a BMP image" : nullptr;
  if (kind) {
    throw DataError(path + ": " + kind +
                    "; flotilla decodes JPEG and PNG only (convert it, or "
                    "move it out of the image folder)");
  }
  throw DataError(path + ": not a JPEG or PNG image (" + std::to_string(bytes.size()) + " bytes" +
                  (bytes.empty() ? ", empty" : "") + "); remove or replace it");
}

} // namespace flotilla::data::detail
