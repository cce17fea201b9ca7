#include "flotilla/train/logs.h"

#include <limits>

#include "flotilla/error.h"

namespace flotilla::train {

void Logs::set(const std::string& key, double value) {
  for (auto& [k, v] : items_) {
    if (k == key) {
      v = value;
      return;
    }
  }
  items_.emplace_back(key, value);
}

std::optional<double> Logs::get(const std::string& key) const {
  for (const auto& [k, v] : items_) {
    if (k == key) return v;
  }
  return std::nullopt;
}

double Logs::at(const std::string& key) const {
  if (auto v = get(key)) return *v;
  std::string keys;
  for (const auto& [k, v] : items_) keys += (keys.empty() ? "" : ", ") + k;
  throw ConfigError("no \"" + key + "\" in the logs; they have: " +
                    (keys.empty() ? std::string("nothing yet") : keys) +
                    (key.rfind("val_", 0) == 0 ? " (val_ keys need validation_data)" : ""));
}

std::vector<double> History::operator[](const std::string& key) const {
  std::vector<double> values;
  for (const auto& e : epochs) {
    values.push_back(e.values.get(key).value_or(std::numeric_limits<double>::quiet_NaN()));
  }
  return values;
}

} // namespace flotilla::train
