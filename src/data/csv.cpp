#include "flotilla/data/csv.h"

#include <cerrno>
#include <cstdlib>
#include <fstream>

#include "data/stages.h"
#include "flotilla/error.h"

namespace flotilla::data {
namespace detail {
namespace {

// Splits a line on the delimiter; a field in double quotes may hold the delimiter and "".
std::vector<std::string> split(const std::string& line, char delimiter) {
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

class CsvStage : public Stage {
 public:
  CsvStage(std::vector<std::string> files, CsvOptions options)
      : Stage("Csv"), files_(std::move(files)), options_(std::move(options)) {}

 protected:
  std::optional<Element> produce() override {
    std::string line;
    for (;;) {
      if (!in_.is_open()) {
        if (next_file_ >= files_.size()) return std::nullopt;
        path_ = files_[next_file_++];
        in_.open(path_);
        if (!in_) throw DataError(path_ + ": cannot open it; check the path");
        line_ = 0;
        if (options_.header) {
          std::getline(in_, line);
          ++line_;
        }
      }
      if (!std::getline(in_, line)) {
        in_.close();
        continue;
      }
      ++line_;
      if (!line.empty() && line.back() == '\r') line.pop_back();
      if (line.empty()) continue; // blank lines, often at the end
      return parse(line);
    }
  }

 private:
  Element parse(const std::string& line) const {
    const std::string where = path_ + ":" + std::to_string(line_);
    const auto fields = split(line, options_.delimiter);
    const auto columns = options_.column_types.size();
    if (fields.size() != columns) {
      throw DataError(where + ": has " + std::to_string(fields.size()) + " fields; expected " +
                      std::to_string(columns) + " (one per column type)");
    }
    const int label = options_.label_column.value_or(-1);
    torch::Tensor features =
        torch::empty({static_cast<std::int64_t>(columns) - (label >= 0 ? 1 : 0)}, torch::kFloat32);
    float* f = features.data_ptr<float>();
    torch::Tensor label_tensor;
    for (std::size_t c = 0; c < columns; ++c) {
      const std::string& text = fields[c];
      const char* begin = text.c_str();
      char* end = nullptr;
      errno = 0;
      double value = 0;
      std::int64_t integer = 0;
      if (options_.column_types[c] == ColumnType::kInt64) {
        integer = std::strtoll(begin, &end, 10);
        value = static_cast<double>(integer);
      } else {
        value = std::strtod(begin, &end);
      }
      while (end && *end == ' ') ++end;
      if (text.empty() || end == begin || *end != '\0' || errno == ERANGE) {
        throw DataError(
            where + ": column " + std::to_string(c) + ": \"" + text + "\" is not " +
            (options_.column_types[c] == ColumnType::kInt64 ? "an integer" : "a number"));
      }
      if (static_cast<int>(c) == label) {
        label_tensor = options_.column_types[c] == ColumnType::kInt64
                           ? torch::tensor(integer, torch::kInt64)
                           : torch::tensor(static_cast<float>(value), torch::kFloat32);
      } else {
        *f++ = static_cast<float>(value);
      }
    }
    if (label < 0) return Element{features};
    return Element{features, label_tensor};
  }

  std::vector<std::string> files_;
  CsvOptions options_;
  std::size_t next_file_ = 0;
  std::ifstream in_;
  std::string path_;
  std::int64_t line_ = 0;
};

class CsvNode : public FileSourceNode {
 public:
  CsvNode(std::vector<std::string> files, CsvOptions csv, const Options& options)
      : FileSourceNode(std::move(files), options), csv_(std::move(csv)) {}
  std::unique_ptr<Stage> make_iterator(const IteratorContext&) const override {
    return std::make_unique<CsvStage>(files_, csv_);
  }
  std::string describe() const override {
    std::string types;
    for (auto t : csv_.column_types) types += t == ColumnType::kInt64 ? 'i' : 'f';
    return "csv(" + types + "," + std::to_string(csv_.header) + "," +
           std::string(1, csv_.delimiter) + "," + std::to_string(csv_.label_column.value_or(-1)) +
           "|" + describe_files() + ")";
  }
  NodePtr with_files(std::vector<std::string> files) const override {
    return std::make_shared<CsvNode>(std::move(files), csv_, options());
  }

 private:
  CsvOptions csv_;
};

} // namespace
} // namespace detail

Dataset csv_dataset(const std::vector<std::string>& files, const CsvOptions& options) {
  if (options.column_types.empty()) {
    throw ConfigError("csv_dataset needs column_types, one per column; saw none");
  }
  if (options.label_column &&
      (*options.label_column < 0 ||
       *options.label_column >= static_cast<int>(options.column_types.size()))) {
    throw ConfigError("csv_dataset: label_column " + std::to_string(*options.label_column) +
                      " is out of range for " + std::to_string(options.column_types.size()) +
                      " columns");
  }
  return Dataset(std::make_shared<detail::CsvNode>(files, options, Options{}));
}

} // namespace flotilla::data
