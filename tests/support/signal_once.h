// Test support for the elastic worker programs: which step, if any, this process signals itself
// at. A restarted process runs the same command line, so "once" is kept in a file: the first
// process that arms the signal creates it, and no later one arms it again.
#pragma once

#include <fstream>
#include <string>

namespace flotilla::testing {

// `signal_at` (-1: never) for slot `signal_slot` (-1: any slot) when this process is `slot`;
// with `once_file`, only if that file did not exist yet (it is created now).
inline int armed_signal_step(int signal_at, int signal_slot, int slot,
                             const std::string& once_file) {
  if (signal_at < 0 || (signal_slot >= 0 && slot != signal_slot)) return -1;
  if (once_file.empty()) return signal_at;
  if (std::ifstream(once_file).good()) return -1;
  std::ofstream(once_file) << "signalled\n";
  return signal_at;
}

} // namespace flotilla::testing
