#include "data/csv_parse.h"

#include <cerrno>
#include <cstdlib>

#include "flotilla/error.h"

namespace flotilla::data::detail {

std::vector<std::string> split_csv_line(const std::string& line, char delimiter) {
  std::vector<std::string> fields(1);
  bool quoted = false;
  for (std::size_t i = 0; i < line.size(); ++i) {
    const char c = line[i];
    if (quoted) {
      if (c == '"' && i + 1 < line.size() && line[i + 1] == '"') {
        fields.back() += '"';
        ++i;
      } else if (c == '"') {
        quoted = false;
      } else {
        fields.back() += c;
      }
    } else if (c == '"') {
      quoted = true;
    } else if (c == delimiter) {
      fields.emplace_back();
    } else {
      fields.back() += c;
    }
  }
  return fields;
}

std::vector<CsvValue> parse_csv_line(const std::string& line, char delimiter,
                                     const std::vector<bool>& int64_columns,
                                     const std::string& where) {
  const auto fields = split_csv_line(line, delimiter);
  const auto columns = int64_columns.size();
  if (fields.size() != columns) {
    throw DataError(where + ": has " + std::to_string(fields.size()) + " fields; expected " +
                    std::to_string(columns) + " (one per column type)");
  }
  std::vector<CsvValue> out(columns);
  for (std::size_t c = 0; c < columns; ++c) {
    const std::string& text = fields[c];
    const char* begin = text.c_str();
    char* end = nullptr;
    errno = 0;
    if (int64_columns[c]) {
      out[c].integer = std::strtoll(begin, &end, 10);
      out[c].value = static_cast<double>(out[c].integer);
    } else {
      out[c].value = std::strtod(begin, &end);
    }
    while (end && *end == ' ') ++end;
    // A field with a NUL inside ends early for strtod; the rest must not be ignored.
    const bool whole = end == begin + text.size();
    if (text.empty() || end == begin || !whole || errno == ERANGE) {
      throw DataError(where + ": column " + std::to_string(c) + ": \"" + text + "\" is not " +
                      (int64_columns[c] ? "an integer" : "a number"));
    }
  }
  return out;
}

} // namespace flotilla::data::detail
