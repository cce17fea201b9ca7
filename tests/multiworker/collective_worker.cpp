// A worker process for the cross-process collective tests: joins the cluster in TF_CONFIG (or
// torchrun variables), checks each collective's result against its closed form, and exits
//   0 all results right, 1 a wrong result, or flotilla's exit code for an error it raised.
// Flags: --timeout-ms N; --heartbeat-timeout-ms N; --heartbeat-interval-ms N; --leave-rank R
// (rank R exits right after joining, before collectives); --signal-rank R --signal STOP|KILL
// (rank R sends itself that signal right after joining, while the others go on into an
// all-reduce); --shared-memory 0|1 (CommunicationOptions::shared_memory; with 1 the all-reduces
// must go through it). The cluster token comes from FLOTILLA_CLUSTER_TOKEN /
// FLOTILLA_CLUSTER_TOKEN_FILE, as in flotilla train.
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>

#include "flotilla/cluster/cluster_token.h"
#include "flotilla/cluster/resolvers.h"
#include "flotilla/collective/communicator.h"
#include "flotilla/error.h"

using namespace flotilla;

int main(int argc, char** argv) {
  collective::CommunicationOptions options;
  int leave_rank = -1;
  int signal_rank = -1;
  int signal = 0;
  int shared = -1;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--timeout-ms")) {
      options.timeout = std::chrono::milliseconds(std::atoi(argv[i + 1]));
    } else if (!std::strcmp(argv[i], "--heartbeat-timeout-ms")) {
      options.heartbeat_timeout = std::chrono::milliseconds(std::atoi(argv[i + 1]));
    } else if (!std::strcmp(argv[i], "--heartbeat-interval-ms")) {
      options.heartbeat_interval = std::chrono::milliseconds(std::atoi(argv[i + 1]));
    } else if (!std::strcmp(argv[i], "--leave-rank")) {
      leave_rank = std::atoi(argv[i + 1]);
    } else if (!std::strcmp(argv[i], "--signal-rank")) {
      signal_rank = std::atoi(argv[i + 1]);
    } else if (!std::strcmp(argv[i], "--shared-memory")) {
      shared = std::atoi(argv[i + 1]);
      options.shared_memory = shared != 0;
    } else if (!std::strcmp(argv[i], "--signal")) {
      signal = !std::strcmp(argv[i + 1], "STOP") ? SIGSTOP : SIGKILL;
    }
  }
  try {
    const auto env = cluster::Environment::from_process();
    const auto spec = cluster::resolve_cluster(env);
    options.cluster_token = cluster::cluster_token(env);
    auto comm = collective::Communicator::connect(spec, options);
    if (comm.rank() == leave_rank) return 0;
    if (signal_rank >= 0) {
      comm.barrier().wait(); // everyone fully joined, heartbeats running
      if (comm.rank() == signal_rank) ::raise(signal);
    }
    const int world = comm.size();
    const std::int64_t n = (1 << 20) + 3;
    const auto base = (torch::arange(n, torch::kInt64) % 13 + 1).to(torch::kFloat32);
    bool ok = true;

    auto sum = base * (comm.rank() + 1);
    if (shared == 1 && comm.transport(sum) != "shared memory") {
      std::cerr << "error: the all-reduce would go through " << comm.transport(sum) << std::endl;
      return 1;
    }
    comm.all_reduce(sum).wait();
    ok &= torch::allclose(sum, base * (world * (world + 1) / 2.0));

    auto b = torch::full({5}, static_cast<float>(comm.rank()));
    comm.broadcast(b, world - 1).wait();
    ok &= torch::equal(b, torch::full({5}, static_cast<float>(world - 1)));

    auto gather = comm.all_gather(torch::tensor({comm.rank()}, torch::kInt64));
    gather.wait();
    ok &= static_cast<int>(gather.result().size()) == world;
    for (int r = 0; ok && r < world; ++r) ok &= gather.result()[r].item<std::int64_t>() == r;

    comm.barrier().wait();
    std::cout << "rank " << comm.rank() << " of " << world << (ok ? " ok" : " WRONG") << std::endl;
    return ok ? 0 : 1;
  } catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << std::endl;
    return exit_code(e);
  }
}
