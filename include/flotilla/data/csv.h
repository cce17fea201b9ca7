// CSV files as a Dataset (tf.data.experimental.CsvDataset, simplified): typed columns, an
// optional header line, and an optional label column. Each line becomes (features float32 [n])
// or (features, label), the label int64 or float32 by its column's type. A line with the wrong
// number of fields or a field that is not a number is a DataError naming the file and line.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "flotilla/data/dataset.h"

namespace flotilla::data {

enum class ColumnType { kFloat, kInt64 };

struct CsvOptions {
  std::vector<ColumnType> column_types; // one per column; their number is the columns expected
  bool header = true;                   // skip the first line of each file
  char delimiter = ',';
  std::optional<int> label_column; // this column becomes the label; the rest are features
};

Dataset csv_dataset(const std::vector<std::string>& files, const CsvOptions& options);

} // namespace flotilla::data
