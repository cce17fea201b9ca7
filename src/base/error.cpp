#include "flotilla/error.h"

namespace flotilla {

int exit_code(const std::exception& e) {
  if (dynamic_cast<const ConfigError*>(&e) || dynamic_cast<const DataError*>(&e)) {
    return kExitBadInput;
  }
  if (dynamic_cast<const CommError*>(&e)) return kExitComm;
  if (dynamic_cast<const CheckpointError*>(&e)) return kExitCheckpoint;
  if (dynamic_cast<const Preempted*>(&e)) return kExitPreempted;
  return kExitFailure;
}

} // namespace flotilla
