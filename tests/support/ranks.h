// Test support: run one function per rank, each on its own thread, over an in-memory group.
#pragma once

#include <exception>
#include <functional>
#include <thread>
#include <vector>

#include "flotilla/cluster/cluster_spec.h"
#include "flotilla/collective/communicator.h"

namespace flotilla::testing {

// Tests default to a short timeout: a rank that fails an assertion and returns early must not
// keep its peers waiting for minutes.
inline collective::CommunicationOptions test_options() {
  collective::CommunicationOptions options;
  options.timeout = std::chrono::seconds(30);
  return options;
}

inline void run_ranks(int world_size,
                      const std::function<void(int rank, collective::Communicator& comm)>& body,
                      const collective::CommunicationOptions& options = test_options()) {
  auto comms = collective::Communicator::local_group(world_size, options);
  std::vector<std::exception_ptr> errors(world_size);
  std::vector<std::thread> threads;
  for (int r = 0; r < world_size; ++r) {
    threads.emplace_back([&, r] {
      try {
        body(r, comms[r]);
      } catch (...) {
        errors[r] = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (auto& e : errors) {
    if (e) std::rethrow_exception(e);
  }
}

// The ClusterSpec a thread-rank would have been given by TF_CONFIG.
inline cluster::ClusterSpec thread_cluster(int rank, int world_size) {
  cluster::ClusterSpec spec;
  for (int r = 0; r < world_size; ++r) spec.worker.push_back({"127.0.0.1", 10000 + r});
  spec.task = {cluster::TaskType::kWorker, rank};
  spec.world_size = world_size;
  spec.rank = rank;
  spec.rendezvous = spec.worker.front();
  spec.local_host = "127.0.0.1";
  spec.source = "test threads";
  return spec;
}

// TF_CONFIG for worker `index` of a cluster of workers on 127.0.0.1 at `ports` (worker 0 is the
// chief), for tests that start real processes.
inline std::string loopback_tf_config(const std::vector<int>& ports, int index) {
  cluster::ClusterSpec spec;
  for (int p : ports) spec.worker.push_back({"127.0.0.1", p});
  spec.task = {cluster::TaskType::kWorker, index};
  return cluster::to_tf_config(spec);
}

} // namespace flotilla::testing
