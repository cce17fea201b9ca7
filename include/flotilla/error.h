// Errors flotilla raises. Every message says what was wrong, the value seen and what to do;
// the CLI maps each kind to an exit code (see exit_code) and prints it as one line.
#pragma once

#include <stdexcept>
#include <string>

namespace flotilla {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Bad configuration: TF_CONFIG, environment, flags, options.
class ConfigError : public Error {
 public:
  using Error::Error;
};

// Bad input data: missing, truncated or malformed files.
class DataError : public Error {
 public:
  using Error::Error;
};

// A collective failed: a peer closed its connection, a backend reported an error.
class CommError : public Error {
 public:
  using Error::Error;
};

// A collective or rendezvous did not complete within its timeout.
class TimeoutError : public CommError {
 public:
  using CommError::CommError;
};

// A checkpoint could not be written or read.
class CheckpointError : public Error {
 public:
  using Error::Error;
};

// Process exit codes the CLI and launcher use.
inline constexpr int kExitOk = 0;
inline constexpr int kExitFailure = 1;    // anything unexpected
inline constexpr int kExitBadInput = 2;   // ConfigError, DataError, bad flags
inline constexpr int kExitComm = 3;       // CommError, TimeoutError
inline constexpr int kExitCheckpoint = 4; // CheckpointError

// The exit code for an exception thrown out of a command.
int exit_code(const std::exception& e);

} // namespace flotilla
