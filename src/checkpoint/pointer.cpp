#include "flotilla/checkpoint/pointer.h"

#include <cctype>
#include <cstdio>
#include <sstream>
#include <string>

#include "flotilla/error.h"

namespace flotilla::checkpoint {

namespace {

// ---- the pointer file (protobuf text format of tensorflow.CheckpointState) ----------------------

std::string escape(const std::string& value) {
  std::string out;
  for (unsigned char c : value) {
    switch (c) {
    case '\\':
      out += "\\\\";
      break;
    case '"':
      out += "\\\"";
      break;
    case '\'':
      out += "\\'";
      break;
    case '\n':
      out += "\\n";
      break;
    case '\r':
      out += "\\r";
      break;
    case '\t':
      out += "\\t";
      break;
    default:
      if (c < 0x20 || c >= 0x7f) { // as protobuf's CEscape writes them
        char octal[5];
        std::snprintf(octal, sizeof octal, "\\%03o", c);
        out += octal;
      } else {
        out += static_cast<char>(c);
      }
    }
  }
  return out;
}

// One quoted string starting at text[i] (which is ' or "); advances i past it.
std::string unquote(const std::string& text, std::size_t& i, const std::string& where) {
  const char quote = text[i++];
  std::string out;
  while (i < text.size() && text[i] != quote) {
    char c = text[i++];
    if (c == '\n') break;
    if (c != '\\') {
      out += c;
      continue;
    }
    if (i >= text.size()) break;
    c = text[i++];
    switch (c) {
    case 'n':
      out += '\n';
      break;
    case 'r':
      out += '\r';
      break;
    case 't':
      out += '\t';
      break;
    case 'a':
      out += '\a';
      break;
    case 'b':
      out += '\b';
      break;
    case 'f':
      out += '\f';
      break;
    case 'v':
      out += '\v';
      break;
    case 'x': {
      int value = 0, digits = 0;
      while (digits < 2 && i < text.size() && std::isxdigit(static_cast<unsigned char>(text[i]))) {
        value = value * 16 + std::stoi(std::string(1, text[i++]), nullptr, 16);
        ++digits;
      }
      if (digits == 0) throw CheckpointError(where + "bad \\x escape");
      out += static_cast<char>(value);
      break;
    }
    default:
      if (c >= '0' && c <= '7') {
        int value = c - '0', digits = 1;
        while (digits < 3 && i < text.size() && text[i] >= '0' && text[i] <= '7') {
          value = value * 8 + (text[i++] - '0');
          ++digits;
        }
        out += static_cast<char>(value);
      } else {
        out += c; // \\ \" \' \?
      }
    }
  }
  if (i >= text.size() || text[i] != quote) throw CheckpointError(where + "unterminated string");
  ++i;
  return out;
}

} // namespace

CheckpointPointer parse_pointer(const std::string& text, const std::string& file) {
  CheckpointPointer pointer;
  std::istringstream lines(text);
  std::string line;
  int number = 0;
  while (std::getline(lines, line)) {
    ++number;
    const std::string where = file + ":" + std::to_string(number) + ": ";
    std::size_t i = line.find_first_not_of(" \t\r");
    if (i == std::string::npos || line[i] == '#') continue;
    const std::size_t colon = line.find(':', i);
    if (colon == std::string::npos) {
      throw CheckpointError(where + "expected \"field: value\", found \"" + line + "\"");
    }
    std::string field = line.substr(i, colon - i);
    field.erase(field.find_last_not_of(" \t") + 1);
    i = line.find_first_not_of(" \t", colon + 1);
    const bool quoted = i != std::string::npos && (line[i] == '"' || line[i] == '\'');
    if (field == "model_checkpoint_path" || field == "all_model_checkpoint_paths") {
      if (!quoted) throw CheckpointError(where + field + " is not a quoted string");
      std::string value = unquote(line, i, where);
      if (field == "model_checkpoint_path") {
        pointer.model_checkpoint_path = std::move(value);
      } else {
        pointer.all_model_checkpoint_paths.push_back(std::move(value));
      }
    }
    // all_model_checkpoint_timestamps, last_preserved_timestamp: TensorFlow's, not needed here.
  }
  if (pointer.model_checkpoint_path.empty()) {
    throw CheckpointError(file +
                          ": has no model_checkpoint_path; the file is not a checkpoint pointer "
                          "or is damaged. Delete it: restore_latest then looks at the checkpoint "
                          "directories themselves");
  }
  return pointer;
}

std::string format_pointer(const CheckpointPointer& pointer) {
  std::string text = "model_checkpoint_path: \"" + escape(pointer.model_checkpoint_path) + "\"\n";
  for (const auto& path : pointer.all_model_checkpoint_paths) {
    text += "all_model_checkpoint_paths: \"" + escape(path) + "\"\n";
  }
  return text;
}

} // namespace flotilla::checkpoint
