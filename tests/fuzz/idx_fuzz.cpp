// An IDX file, gzip'd or raw, read through zlib as read_idx reads one from disk: the bytes are
// put in an in-memory file (memfd) so that gzread sees a real descriptor.
#include <sys/mman.h>
#include <unistd.h>

#include <cstdlib>

#include "data/idx_format.h"
#include "tests/fuzz/fuzz_support.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const int fd = memfd_create("idx", 0);
  if (fd < 0) std::abort(); // the harness itself is broken; not a finding
  for (std::size_t done = 0; done < size;) {
    const ssize_t n = write(fd, data + done, size - done);
    if (n <= 0) std::abort();
    done += static_cast<std::size_t>(n);
  }
  lseek(fd, 0, SEEK_SET);
  gzFile file = gzdopen(fd, "rb"); // owns fd from here
  if (!file) std::abort();
  std::optional<std::int64_t> stored_size;
  if (gzdirect(file)) stored_size = static_cast<std::int64_t>(size);
  flotilla::fuzz::expect_only_flotilla_errors(
      [&] { flotilla::data::detail::read_idx_array(file, "fuzz.idx", stored_size); });
  gzclose(file);
  return 0;
}
