// What an input pipeline needs to know about distribution (tf.distribute.InputContext): how
// many pipelines there are, which one this is, and how a global batch splits across replicas.
#pragma once

#include <cstdint>

namespace flotilla::strategy {

struct InputContext {
  int num_input_pipelines = 1; // one per worker
  int input_pipeline_id = 0;   // this worker's index among them
  int num_replicas_in_sync = 1;

  // global_batch ÷ num_replicas_in_sync; ConfigError when it does not divide evenly.
  std::int64_t get_per_replica_batch_size(std::int64_t global_batch) const;
};

} // namespace flotilla::strategy
