#include "flotilla/data/csv.h"

#include <fstream>

#include "data/csv_parse.h"
#include "data/stages.h"
#include "flotilla/error.h"

namespace flotilla::data {
namespace detail {
namespace {

class CsvStage : public Stage {
 public:
  CsvStage(std::vector<std::string> files, CsvOptions options)
      : Stage("Csv"), files_(std::move(files)), options_(std::move(options)) {
    for (auto type : options_.column_types) int64_columns_.push_back(type == ColumnType::kInt64);
  }

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
    const auto values = parse_csv_line(line, options_.delimiter, int64_columns_,
                                       path_ + ":" + std::to_string(line_));
    const auto columns = values.size();
    const int label = options_.label_column.value_or(-1);
    torch::Tensor features =
        torch::empty({static_cast<std::int64_t>(columns) - (label >= 0 ? 1 : 0)}, torch::kFloat32);
    float* f = features.data_ptr<float>();
    torch::Tensor label_tensor;
    for (std::size_t c = 0; c < columns; ++c) {
      if (static_cast<int>(c) == label) {
        label_tensor = int64_columns_[c]
                           ? torch::tensor(values[c].integer, torch::kInt64)
                           : torch::tensor(static_cast<float>(values[c].value), torch::kFloat32);
      } else {
        *f++ = static_cast<float>(values[c].value);
      }
    }
    if (label < 0) return Element{features};
    return Element{features, label_tensor};
  }

  std::vector<std::string> files_;
  CsvOptions options_;
  std::vector<bool> int64_columns_;
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
