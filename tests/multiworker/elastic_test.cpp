// Elastic membership across real processes: a rendezvous outside the workers (the service
// flotilla rendezvous and flotilla launch --elastic host), Gloo groups formed generation by
// generation. A killed chief, a stopped worker, a restarted worker rejoining.
#include "flotilla/collective/elastic.h"

#include <gtest/gtest.h>

#include <csignal>
#include <map>
#include <memory>
#include <regex>
#include <sstream>
#include <thread>

#include "flotilla/cluster/resolvers.h"
#include "flotilla/error.h"
#include "support/paths.h"
#include "support/ranks.h"
#include "support/subprocess.h"

namespace flotilla {
namespace {

using testing::Process;
using testing::ProcessResult;

const std::string kWorker = flotilla::testing::test_bin_dir() + "/elastic_worker";

struct Cluster {
  std::unique_ptr<collective::RendezvousService> service;
  std::vector<int> ports;
  explicit Cluster(int workers, std::chrono::milliseconds heartbeat_timeout) {
    collective::RendezvousService::Options options;
    options.listen = {"127.0.0.1", 0};
    options.workers = workers;
    options.heartbeat_timeout = heartbeat_timeout;
    service = std::make_unique<collective::RendezvousService>(options);
    ports = testing::free_ports(workers);
  }
  std::unique_ptr<Process> start(int slot, std::vector<std::string> flags) {
    std::vector<std::string> argv = {kWorker};
    argv.insert(argv.end(), flags.begin(), flags.end());
    return std::make_unique<Process>(
        argv,
        std::map<std::string, std::string>{{"TF_CONFIG", testing::loopback_tf_config(ports, slot)},
                                           {"FLOTILLA_RENDEZVOUS", service->address()}});
  }
};

// The steps a worker completed, in order: "step K gen ... ok" lines.
std::vector<int> completed_steps(const std::string& out) {
  std::vector<int> steps;
  std::istringstream in(out);
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("step ", 0) == 0) steps.push_back(std::stoi(line.substr(5)));
  }
  return steps;
}

void expect_each_step_once(const std::vector<int>& steps, int from, const std::string& who) {
  ASSERT_FALSE(steps.empty()) << who;
  for (std::size_t i = 0; i < steps.size(); ++i) {
    EXPECT_EQ(steps[i], from + static_cast<int>(i)) << who << ": step " << i << " of the ledger";
  }
}

TEST(Elastic, AKilledChiefIsDroppedAtOnceTheLowestSurvivorLeadsAndItsRestartRejoins) {
  Cluster cluster(3, std::chrono::seconds(30)); // detection must not wait for the heartbeat
  const std::vector<std::string> flags = {"--steps", "8", "--until-members", "3"};
  auto chief_flags = flags;
  chief_flags.insert(chief_flags.end(), {"--signal-at", "2", "--signal", "KILL"});
  auto chief = cluster.start(0, chief_flags);
  auto one = cluster.start(1, flags);
  auto two = cluster.start(2, flags);
  const auto killed = chief->wait(std::chrono::seconds(60));
  EXPECT_EQ(killed.exit_code, 128 + SIGKILL) << killed.err;
  ASSERT_TRUE(one->wait_for_output("regrouped")) << one->output_so_far();
  auto restarted = cluster.start(0, flags);
  const auto back = restarted->wait(std::chrono::seconds(90));
  const auto r1 = one->wait(std::chrono::seconds(30));
  const auto r2 = two->wait(std::chrono::seconds(30));
  EXPECT_EQ(back.exit_code, 0) << back.out << back.err;
  EXPECT_EQ(r1.exit_code, 0) << r1.out << r1.err;
  EXPECT_EQ(r2.exit_code, 0) << r2.out << r2.err;
  std::cout << "slot 1:\n" << r1.out << "restarted chief:\n" << back.out;

  // Noticed by the closed connection, not by 30 s of silence; slot 1 is the new rank 0.
  EXPECT_NE(r1.out.find("generation 1 [1,2] (slot 0 lost its connection to the rendezvous (the "
                        "process exited or was killed))"),
            std::string::npos)
      << r1.out;
  EXPECT_NE(r1.out.find("step 2 gen 1 rank 0/2 sum 5 ok"), std::string::npos) << r1.out;
  EXPECT_NE(r2.out.find("step 2 gen 1 rank 1/2 sum 5 ok"), std::string::npos) << r2.out;
  // The restart is admitted at a step boundary and the group is whole again.
  EXPECT_NE(r1.out.find("admitted: generation 2 [0,1,2] (admitted slot 0)"), std::string::npos)
      << r1.out;
  EXPECT_NE(back.out.find(" joined: generation 2 [0,1,2]"), std::string::npos) << back.out;
  EXPECT_NE(back.out.find(" gen 2 rank 0/3 sum 6 ok"), std::string::npos) << back.out;
  EXPECT_EQ(r1.out.find("WRONG"), std::string::npos) << r1.out;
  // Every step exactly once on each survivor: the failed step 2 was redone, none skipped.
  expect_each_step_once(completed_steps(r1.out), 0, "slot 1");
  expect_each_step_once(completed_steps(r2.out), 0, "slot 2");
  const auto rejoined = completed_steps(back.out);
  ASSERT_FALSE(rejoined.empty());
  expect_each_step_once(rejoined, rejoined.front(), "restarted slot 0");
  EXPECT_EQ(completed_steps(r1.out).back(), rejoined.back());
}

// Three workers (heartbeat timeout 1.5 s, 6 steps); slot 2 stops itself with SIGSTOP where
// `when` says, is woken once slot 0 has regrouped without it, and all three run to their end.
struct StoppedRun {
  ProcessResult r0, r1, woke;
};
void run_with_slot_2_stopped(const std::vector<std::string>& when, StoppedRun& run) {
  Cluster cluster(3, std::chrono::milliseconds(1500));
  const std::vector<std::string> flags = {"--steps", "6", "--heartbeat-timeout-ms", "1500"};
  auto stopping = flags;
  stopping.insert(stopping.end(), {"--signal", "STOP"});
  stopping.insert(stopping.end(), when.begin(), when.end());
  auto zero = cluster.start(0, flags);
  auto one = cluster.start(1, flags);
  auto stopped = cluster.start(2, stopping);
  ASSERT_TRUE(zero->wait_for_output("regrouped")) << zero->output_so_far();
  stopped->signal(SIGCONT);
  run.r0 = zero->wait(std::chrono::seconds(60));
  run.r1 = one->wait(std::chrono::seconds(60));
  run.woke = stopped->wait(std::chrono::seconds(60));
}

TEST(Elastic, AStoppedWorkerIsExpelledAfterTheHeartbeatTimeoutAndToldSoWhenItWakes) {
  StoppedRun run;
  ASSERT_NO_FATAL_FAILURE(run_with_slot_2_stopped({"--signal-at", "2"}, run));
  const auto& [r0, r1, woke] = run;
  EXPECT_EQ(r0.exit_code, 0) << r0.out << r0.err;
  EXPECT_EQ(r1.exit_code, 0) << r1.out << r1.err;
  EXPECT_NE(r0.out.find("generation 1 [0,1] (slot 2 stopped sending heartbeats for 1500 ms "
                        "(stopped, hung, or cut off from the network))"),
            std::string::npos)
      << r0.out;
  EXPECT_NE(r0.out.find("step 2 gen 1 rank 0/2 sum 3 ok"), std::string::npos) << r0.out;
  expect_each_step_once(completed_steps(r0.out), 0, "slot 0");
  expect_each_step_once(completed_steps(r1.out), 0, "slot 1");
  // The stopped worker cannot slip back into a group that went on without it, nor complete its
  // step 2 against the all-reduce generation 0 abandoned (still pending in Gloo's threads).
  EXPECT_EQ(woke.exit_code, kExitComm) << woke.out << woke.err;
  EXPECT_EQ(woke.out.find("step 2 gen 0"), std::string::npos) << woke.out;
  EXPECT_NE(woke.err.find("expelled"), std::string::npos) << woke.err;
}

// A step whose all-reduce completed in a generation the others then replaced without this worker
// is not this worker's to act on (ElasticGroup::confirm_membership): slot 2 stops itself
// (SIGSTOP) right after its step 3's all-reduce completed; the others wait for it in the next
// collective, its heartbeat falls silent, and they go on in generation 1 without it. Woken, it
// must not print (commit) step 3: it exits as expelled. Without the check it printed
// "step 3 gen 0 rank 2/3 sum 6 ok".
TEST(Elastic, AWorkerExpelledWhileItDidNotRunDoesNotCommitTheStepItCompleted) {
  StoppedRun run;
  ASSERT_NO_FATAL_FAILURE(
      run_with_slot_2_stopped({"--signal-at", "3", "--signal-after-all-reduce", "1"}, run));
  const auto& [r0, r1, woke] = run;
  EXPECT_EQ(r0.exit_code, 0) << r0.out << r0.err;
  EXPECT_EQ(r1.exit_code, 0) << r1.out << r1.err;
  EXPECT_NE(r0.out.find("generation 1 [0,1] (slot 2 stopped sending heartbeats"),
            std::string::npos)
      << r0.out;
  expect_each_step_once(completed_steps(r0.out), 0, "slot 0");
  EXPECT_NE(woke.out.find("step 2 gen 0 rank 2/3 sum 6 ok"), std::string::npos) << woke.out;
  EXPECT_EQ(woke.out.find("step 3 gen 0"), std::string::npos) << woke.out;
  EXPECT_EQ(woke.exit_code, kExitComm) << woke.out << woke.err;
  EXPECT_NE(woke.err.find("expelled"), std::string::npos) << woke.err;
}

TEST(Elastic, AMismatchedModeOrAChiefHostedRendezvousIsAClearError) {
  collective::RendezvousService::Options options;
  options.listen = {"127.0.0.1", 0};
  options.workers = 2;
  collective::RendezvousService service(options);
  const auto ports = testing::free_ports(2);
  cluster::Environment env({{"TF_CONFIG", testing::loopback_tf_config(ports, 1)},
                            {"FLOTILLA_RENDEZVOUS", service.address()}});
  const auto spec = cluster::resolve_cluster(env);
  EXPECT_TRUE(spec.external_rendezvous);
  EXPECT_EQ(spec.rendezvous.to_string(), service.address());
  collective::CommunicationOptions comm;
  comm.timeout = std::chrono::seconds(10);
  try {
    collective::Communicator::connect(spec, comm);
    FAIL() << "a fixed-membership task joined an elastic rendezvous";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("this rendezvous runs an elastic group and the task is "
                                         "not elastic"),
              std::string::npos)
        << e.what();
  }
  auto chief_hosted = spec;
  chief_hosted.external_rendezvous = false;
  try {
    collective::ElasticGroup::join(chief_hosted, comm);
    FAIL() << "an elastic group started without an outside rendezvous";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("FLOTILLA_RENDEZVOUS"), std::string::npos) << e.what();
  }
}

} // namespace
} // namespace flotilla
