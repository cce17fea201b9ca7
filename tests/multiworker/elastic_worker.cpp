// A worker process for the elastic-membership tests: joins the elastic group at
// FLOTILLA_RENDEZVOUS as TF_CONFIG's task, and runs numbered steps, each one all-reduce of
// (slot + 1) checked against the sum over the generation's members. A collective that fails
// (a member died, froze, left) is answered with ElasticGroup::regroup() and the step is
// redone; each step is confirmed (ElasticGroup::confirm_membership) before it is printed; at
// every step boundary the members vote (MAX of waiting()) and admit restarted
// workers together. After any change of generation the members agree on the next step
// (MAX), so a restarted worker picks up where the group is. Prints one line per event:
//   step K gen G rank R/N sum S ok|WRONG
//   regrouped after T ms: generation G (reason)
//   admitted: generation G (reason)
// and exits 0 when every sum was right, 1 otherwise, or flotilla's exit code for an error.
// Flags: --steps N (default 6); --until-members M (go on past N steps until the group has M
// members again and 3 steps more, at most 600 steps); --step-ms MS (sleep per step, default 20);
// --signal-at K --signal STOP|KILL|HANG|NAP (this process sends itself the signal at step K,
// before its all-reduce, while the others are inside theirs; HANG: its training thread sleeps for
// ever there, while its heartbeat goes on; NAP: it sleeps --nap-ms MS there once, then goes on);
// --signal-after-all-reduce 1 (sends it once step K's all-reduce completed, before the step is
// confirmed); --signal-slot S (only slot S does);
// --signal-once FILE (only when FILE does not exist yet; it is created first, so a restarted
// process does not signal itself again); --heartbeat-timeout-ms,
// --heartbeat-interval-ms, --timeout-ms.
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <thread>
#include <unistd.h>

#include "flotilla/cluster/cluster_token.h"
#include "flotilla/cluster/resolvers.h"
#include "flotilla/collective/elastic.h"
#include "flotilla/error.h"
#include "support/signal_once.h"

using namespace flotilla;
using Clock = std::chrono::steady_clock;

int main(int argc, char** argv) {
  collective::CommunicationOptions options;
  options.timeout = std::chrono::seconds(60);
  options.heartbeat_interval = std::chrono::milliseconds(200);
  options.heartbeat_timeout = std::chrono::seconds(2);
  int steps = 6, until_members = 0, step_ms = 20, signal_at = -1, signal = SIGKILL;
  int signal_slot = -1, nap_ms = 0;
  bool signal_after = false;
  std::string signal_once;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    const int value = std::atoi(argv[i + 1]);
    if (flag == "--steps") steps = value;
    if (flag == "--until-members") until_members = value;
    if (flag == "--step-ms") step_ms = value;
    if (flag == "--signal-at") signal_at = value;
    if (flag == "--signal-slot") signal_slot = value;
    if (flag == "--signal-after-all-reduce") signal_after = value != 0;
    if (flag == "--signal-once") signal_once = argv[i + 1];
    if (flag == "--nap-ms") nap_ms = value;
    if (flag == "--signal") {
      signal = !std::strcmp(argv[i + 1], "STOP")   ? SIGSTOP
               : !std::strcmp(argv[i + 1], "HANG") ? 0
               : !std::strcmp(argv[i + 1], "NAP")  ? -1
                                                   : SIGKILL;
    }
    if (flag == "--timeout-ms") options.timeout = std::chrono::milliseconds(value);
    if (flag == "--heartbeat-timeout-ms") {
      options.heartbeat_timeout = std::chrono::milliseconds(value);
    }
    if (flag == "--heartbeat-interval-ms") {
      options.heartbeat_interval = std::chrono::milliseconds(value);
    }
  }
  try {
    const auto env = cluster::Environment::from_process();
    const auto spec = cluster::resolve_cluster(env);
    options.cluster_token = cluster::cluster_token(env);
    auto group = collective::ElasticGroup::join(spec, options);
    signal_at = testing::armed_signal_step(signal_at, signal_slot, group->slot(), signal_once);
    bool ok = true;
    std::int64_t step = 0;
    bool synced = false; // the members agreed on `step` in this generation
    const auto members_of = [&] {
      std::string out;
      for (int s : group->members()) out += (out.empty() ? "" : ",") + std::to_string(s);
      return out;
    };
    std::cout << "pid " << ::getpid() << " joined: generation " << group->generation() << " ["
              << members_of() << "] (" << group->reason() << ")" << std::endl;
    // Decided only in agreement (synced): every member stops at the same step.
    std::int64_t whole_at = -1; // the step at which the group had until_members again
    const auto more = [&] {
      if (until_members == 0) return step < steps;
      if (whole_at < 0) return step < 600;
      return step < std::max<std::int64_t>(steps, whole_at + 3);
    };
    while (!synced || more()) {
      auto& comm = group->communicator();
      try {
        if (!synced) {
          auto next = torch::tensor({step}, torch::kInt64);
          comm.all_reduce(next, collective::ReduceOp::kMax).wait();
          step = next.item<std::int64_t>();
          synced = true;
          if (whole_at < 0 && until_members > 0 &&
              static_cast<int>(group->members().size()) >= until_members && step > 0) {
            whole_at = step;
          }
          continue;
        }
        if (step == signal_at && signal == 0) {
          for (;;) std::this_thread::sleep_for(std::chrono::hours(1));
        }
        if (step == signal_at && signal == -1) {
          std::this_thread::sleep_for(std::chrono::milliseconds(nap_ms));
          signal_at = -1; // once: not again when the step is redone
        } else if (step == signal_at && !signal_after) {
          ::raise(signal);
        }
        auto value = torch::full({1000}, static_cast<float>(group->slot() + 1));
        comm.all_reduce(value).wait();
        if (step == signal_at && signal_after && signal > 0) ::raise(signal);
        group->confirm_membership(); // as fit does before a step's callbacks
        float expected = 0;
        for (int s : group->members()) expected += static_cast<float>(s + 1);
        const bool right = torch::equal(value, torch::full({1000}, expected));
        ok &= right;
        std::cout << "step " << step << " gen " << group->generation() << " rank " << comm.rank()
                  << "/" << comm.size() << " sum " << value[0].item<float>()
                  << (right ? " ok" : " WRONG") << std::endl;
        ++step;
        auto vote = torch::tensor({group->waiting()}, torch::kInt64);
        comm.all_reduce(vote, collective::ReduceOp::kMax).wait();
        if (vote.item<std::int64_t>() > 0 && group->admit()) {
          std::cout << "admitted: generation " << group->generation() << " [" << members_of()
                    << "] (" << group->reason() << ")" << std::endl;
          synced = false;
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(step_ms));
      } catch (const CommError& e) {
        const auto failed_at = Clock::now();
        std::cerr << "step " << step << " failed: " << e.what() << std::endl;
        group->regroup();
        const auto ms =
            std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - failed_at);
        std::cout << "regrouped after " << ms.count() << " ms: generation " << group->generation()
                  << " [" << members_of() << "] (" << group->reason() << ")" << std::endl;
        synced = false;
      }
    }
    std::cout << "done at step " << step << " with [" << members_of() << "]" << std::endl;
    return ok ? 0 : 1;
  } catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << std::endl;
    return exit_code(e);
  }
}
