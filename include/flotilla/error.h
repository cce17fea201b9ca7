// Errors flotilla raises. Every message says what was wrong, the value seen and what to do;
// the CLI maps each kind to an exit code (see exit_code) and prints it as one line.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <string_view>

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

// Elastic mode: the collective's group lost a member (or admitted new ones) while it ran; the
// operation was abandoned, and the survivors go on in the next generation
// (collective::ElasticGroup::regroup). Outside elastic mode a lost member is a plain CommError.
class GroupChanged : public CommError {
 public:
  using CommError::CommError;
};

// Elastic mode, shares by speed (FitOptions::straggler_floor): this worker was measured so much
// slower than the others that its share of the global batch would fall below the floor, and it
// left the group, which goes on without it. Not healed by this worker; the launcher may restart
// it, and a restart rejoins with a share from its measured speed. Exit code as CommError's.
class Straggler : public Error {
 public:
  using Error::Error;
};

// A checkpoint could not be written or read.
class CheckpointError : public Error {
 public:
  using Error::Error;
};

// Training stopped because a worker was asked to stop (SIGTERM, or train::request_preemption()):
// every worker saved a backup at the same step, and starting the same job again resumes there.
// Thrown out of Model::fit by BackupAndRestore on every worker; not a failure of the job.
class Preempted : public Error {
 public:
  Preempted(const std::string& what, std::int64_t iterations)
      : Error(what), iterations_(iterations) {}
  // The optimizer updates done when the backup was saved (where a restart resumes).
  std::int64_t iterations() const { return iterations_; }

 private:
  std::int64_t iterations_;
};

// Untrusted input as an error message shows it: in double quotes, with quotes, backslashes and
// control bytes escaped (\n, \t, \r, \xHH: a NUL cannot end the message and an escape sequence
// cannot reach the terminal), and cut after `max` bytes, saying how long it was.
std::string echoed(std::string_view text, std::size_t max = 200);

// A whole message as the CLI prints it: control bytes other than newlines escaped, cut after
// `max` bytes.
std::string printable(std::string_view message, std::size_t max = 4000);

// Process exit codes the CLI and launcher use.
inline constexpr int kExitOk = 0;
inline constexpr int kExitFailure = 1;    // anything unexpected
inline constexpr int kExitBadInput = 2;   // ConfigError, DataError, bad flags
inline constexpr int kExitComm = 3;       // CommError, TimeoutError, Straggler
inline constexpr int kExitCheckpoint = 4; // CheckpointError
inline constexpr int kExitDiverged = 5;   // training stopped on non-finite values (TerminateOnNaN)
// Preempted. sysexits' EX_TEMPFAIL ("temporary failure; the user is invited to retry"): a
// scheduler or `flotilla launch` that sees it starts the job again, which resumes from the
// backup; and 75 is not 128 + a signal, so it cannot be mistaken for a worker killed outright.
inline constexpr int kExitPreempted = 75;

// The exit code for an exception thrown out of a command.
int exit_code(const std::exception& e);

} // namespace flotilla
