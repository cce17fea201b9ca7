// Collectives across real processes over real sockets: the rendezvous store hosted by the chief
// at its TF_CONFIG address, Gloo pairs between every two processes.
#include <gtest/gtest.h>

#include <memory>

#include "flotilla/cluster/cluster_spec.h"
#include "flotilla/error.h"
#include "support/paths.h"
#include "support/ranks.h"
#include "support/subprocess.h"

namespace flotilla {
namespace {

using testing::Process;
using testing::ProcessResult;

const std::string kWorker = flotilla::testing::test_bin_dir() + "/collective_worker";

std::vector<ProcessResult> run_cluster(int world, const std::vector<std::string>& flags,
                                       int start_only = -1) {
  const auto ports = testing::free_ports(world);
  std::vector<std::unique_ptr<Process>> procs;
  for (int i = 0; i < world; ++i) {
    if (start_only >= 0 && i != start_only) continue;
    std::vector<std::string> argv = {kWorker};
    argv.insert(argv.end(), flags.begin(), flags.end());
    procs.push_back(std::make_unique<Process>(
        argv,
        std::map<std::string, std::string>{{"TF_CONFIG", testing::loopback_tf_config(ports, i)}}));
  }
  std::vector<ProcessResult> results;
  for (auto& p : procs) results.push_back(p->wait(std::chrono::seconds(120)));
  return results;
}

// Over the ring and through shared memory (the worker checks the all-reduce went through it).
TEST(CollectiveProcesses, TwoAndThreeProcessesAgree) {
  for (const std::string shared : {"0", "1"}) {
    for (int world : {2, 3}) {
      const auto results = run_cluster(world, {"--timeout-ms", "60000", "--shared-memory", shared});
      for (int r = 0; r < world; ++r) {
        EXPECT_EQ(results[r].exit_code, 0) << shared << results[r].err;
        EXPECT_EQ(results[r].out,
                  "rank " + std::to_string(r) + " of " + std::to_string(world) + " ok\n");
      }
    }
  }
}

TEST(CollectiveProcesses, TorchrunVariablesWorkToo) {
  const int port = testing::free_ports(1)[0];
  std::vector<std::unique_ptr<Process>> procs;
  for (int r = 0; r < 2; ++r) {
    procs.push_back(std::make_unique<Process>(
        std::vector<std::string>{kWorker},
        std::map<std::string, std::string>{{"RANK", std::to_string(r)},
                                           {"WORLD_SIZE", "2"},
                                           {"MASTER_ADDR", "127.0.0.1"},
                                           {"MASTER_PORT", std::to_string(port)}}));
  }
  for (int r = 0; r < 2; ++r) {
    const auto result = procs[r]->wait(std::chrono::seconds(120));
    EXPECT_EQ(result.exit_code, 0) << result.err;
  }
}

// Over the ring the others notice the closed connection ("failed (", not the timeout); shared
// memory has no connection to close: they see the process is gone (its communicator's
// destructor says so, or /proc that the process exited).
TEST(CollectiveProcesses, AWorkerThatExitsFailsTheOthersInsteadOfHangingThem) {
  for (const bool shared : {false, true}) {
    const auto results = run_cluster(
        3, {"--timeout-ms", "20000", "--leave-rank", "2", "--shared-memory", shared ? "1" : "0"});
    EXPECT_EQ(results[2].exit_code, 0);
    for (int r = 0; r < 2; ++r) {
      EXPECT_EQ(results[r].exit_code, kExitComm) << shared << results[r].err;
      EXPECT_NE(results[r].err.find("error: all_reduce #1 (sum, 1048579 x float) on rank " +
                                    std::to_string(r) + " of 3 failed (" +
                                    (shared ? "Connection closed: rank 2 " : "")),
                std::string::npos)
          << shared << results[r].err;
      if (shared) {
        EXPECT_NE(
            results[r].err.find(" during the shared-memory all-reduce); a peer probably exited"),
            std::string::npos)
            << results[r].err;
      }
    }
  }
}

TEST(CollectiveProcesses, AMissingWorkerTimesOutTheRendezvousNamingTheChief) {
  // Only the chief starts; worker 1 never comes. Nothing else must happen in time, so the
  // timeout it waits out can be short.
  const auto results = run_cluster(2, {"--timeout-ms", "1000"}, /*start_only=*/0);
  ASSERT_EQ(results.size(), 1u);
  EXPECT_EQ(results[0].exit_code, kExitComm) << results[0].err;
  EXPECT_NE(results[0].err.find("error: worker 0 at 127.0.0.1:"), std::string::npos)
      << results[0].err;
  EXPECT_NE(results[0].err.find("(rank 0): rendezvous with the chief at 127.0.0.1:"),
            std::string::npos)
      << results[0].err;
  EXPECT_NE(results[0].err.find(": 1 of 2 joined within 1 s; worker 1 at 127.0.0.1:"),
            std::string::npos)
      << results[0].err;
  EXPECT_NE(results[0].err.find("(rank 1) did not join"), std::string::npos) << results[0].err;
  EXPECT_NE(results[0].err.find("reach the chief, or raise CommunicationOptions::timeout"),
            std::string::npos)
      << results[0].err;
}

TEST(CollectiveProcesses, AnAbsentChiefTimesOutTheWorker) {
  const auto results = run_cluster(2, {"--timeout-ms", "1000"}, /*start_only=*/1);
  ASSERT_EQ(results.size(), 1u);
  EXPECT_EQ(results[0].exit_code, kExitComm) << results[0].err;
  EXPECT_NE(results[0].err.find("(rank 1) could not reach the chief's rendezvous at 127.0.0.1:"),
            std::string::npos)
      << results[0].err;
  EXPECT_NE(results[0].err.find(" within 1 s (Connection refused)"), std::string::npos)
      << results[0].err;
  EXPECT_NE(results[0].err.find("host can reach it, or raise CommunicationOptions::timeout"),
            std::string::npos)
      << results[0].err;
}

} // namespace
} // namespace flotilla
