// Private: one CSV line split into fields and read as numbers, without LibTorch, so that the
// checks on untrusted input can be fuzzed on their own (tests/fuzz). The CSV dataset makes
// tensors of the values.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace flotilla::data::detail {

// Splits a line on the delimiter; a field in double quotes may hold the delimiter and "".
std::vector<std::string> split_csv_line(const std::string& line, char delimiter);

struct CsvValue {
  double value = 0;         // every column's value, as a number
  std::int64_t integer = 0; // an int64 column's exact value
};

// The line's fields as numbers, one per entry of `int64_columns` (true: the column is int64,
// false: float). DataError, starting with `where` (e.g. "file.csv:12"), on a wrong number of
// fields or a field that is not a number of its column's type.
std::vector<CsvValue> parse_csv_line(const std::string& line, char delimiter,
                                     const std::vector<bool>& int64_columns,
                                     const std::string& where);

} // namespace flotilla::data::detail
