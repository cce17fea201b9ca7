// CSV text read line by line as the CSV dataset reads a file. The first three bytes choose the
// options: the delimiter, the number of columns (1 to 8) and which of them are int64.
#include <sstream>
#include <vector>

#include "data/csv_parse.h"
#include "tests/fuzz/fuzz_support.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size < 3) return 0;
  static const char kDelimiters[] = {',', ';', '\t', '|', ' ', '"'};
  const char delimiter = kDelimiters[data[0] % sizeof kDelimiters];
  std::vector<bool> int64_columns(1 + data[1] % 8);
  for (std::size_t c = 0; c < int64_columns.size(); ++c) int64_columns[c] = (data[2] >> c) & 1;
  std::istringstream in(std::string(reinterpret_cast<const char*>(data) + 3, size - 3));
  std::string line;
  for (int number = 1; std::getline(in, line); ++number) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.empty()) continue;
    flotilla::fuzz::expect_only_flotilla_errors([&] {
      flotilla::data::detail::parse_csv_line(line, delimiter, int64_columns,
                                             "fuzz.csv:" + std::to_string(number));
    });
  }
  return 0;
}
