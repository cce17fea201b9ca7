#include "flotilla/error.h"

namespace flotilla {
namespace {

void escape(std::string& out, unsigned char c, bool keep_newline, bool quote) {
  static const char* const kHex = "0123456789abcdef";
  switch (c) {
  case '\n':
    out += keep_newline ? "\n" : "\\n";
    return;
  case '\t':
    out += "\\t";
    return;
  case '\r':
    out += "\\r";
    return;
  case '"':
  case '\\':
    if (quote) out += '\\';
    out += static_cast<char>(c);
    return;
  default:
    if (c < 0x20 || c == 0x7f) {
      out += "\\x";
      out += kHex[c >> 4];
      out += kHex[c & 15];
    } else {
      out += static_cast<char>(c);
    }
  }
}

} // namespace

std::string echoed(std::string_view text, std::size_t max) {
  std::string out = "\"";
  for (std::size_t i = 0; i < text.size() && i < max; ++i) {
    escape(out, static_cast<unsigned char>(text[i]), false, true);
  }
  out += '"';
  if (text.size() > max) {
    out += " (cut: " + std::to_string(text.size()) + " bytes; the first " + std::to_string(max) +
           " shown)";
  }
  return out;
}

std::string printable(std::string_view message, std::size_t max) {
  std::string out;
  for (std::size_t i = 0; i < message.size() && i < max; ++i) {
    escape(out, static_cast<unsigned char>(message[i]), true, false);
  }
  if (message.size() > max) {
    out += "... (cut: the message has " + std::to_string(message.size()) + " bytes)";
  }
  return out;
}

int exit_code(const std::exception& e) {
  if (dynamic_cast<const ConfigError*>(&e) || dynamic_cast<const DataError*>(&e)) {
    return kExitBadInput;
  }
  if (dynamic_cast<const CommError*>(&e) || dynamic_cast<const Straggler*>(&e)) return kExitComm;
  if (dynamic_cast<const CheckpointError*>(&e)) return kExitCheckpoint;
  if (dynamic_cast<const Preempted*>(&e)) return kExitPreempted;
  return kExitFailure;
}

} // namespace flotilla
