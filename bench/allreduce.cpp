// All-reduce bandwidth of flotilla's Communicator against raw c10d ProcessGroupGloo, in the same
// processes, interleaved size by size (bench/allreduce.sh starts one process per rank with
// torchrun-style RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT). Both sum float32 tensors on the
// same loopback Gloo transport; the difference is flotilla's layer (sequence numbers,
// descriptions, completion times, error mapping). With its third argument 1 flotilla's side runs
// its shared-memory all-reduce instead (every rank here shares the host). Rank 0 prints one JSON
// line per system and size (bus bandwidth as nccl-tests define it: bytes / time x 2(n-1)/n; the
// "transport" each used) and one ratio line.
// (A benchmark may include Gloo's header: it measures c10d itself, not through flotilla.)
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "flotilla/cluster/resolvers.h"
#include "flotilla/collective/communicator.h"

namespace {

using Clock = std::chrono::steady_clock;

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

} // namespace

int main(int argc, char** argv) {
  using namespace flotilla;
  const int rounds = argc > 1 ? std::atoi(argv[1]) : 5;
  const std::int64_t max_bytes = argc > 2 ? std::atoll(argv[2]) : (256ll << 20);
  // 1: flotilla's shared-memory all-reduce where every rank shares this host (its default);
  // 0: its ring over Gloo, the layer whose cost against raw c10d the verdict measures.
  const bool shared_memory = argc > 3 && std::atoi(argv[3]) != 0;
  const auto env = cluster::Environment::from_process();
  const cluster::ClusterSpec spec = cluster::resolve_cluster(env);
  collective::CommunicationOptions options;
  options.implementation = collective::Implementation::kRing;
  options.shared_memory = shared_memory;
  auto comm = collective::Communicator::connect(spec, options);
  const int rank = comm.rank();
  const int size = comm.size();

  // The raw peer: its own store (the next port) and its own Gloo group on the same interface.
  c10d::TCPStoreOptions store_options;
  store_options.port = static_cast<std::uint16_t>(spec.rendezvous.port + 1);
  store_options.isServer = rank == 0;
  store_options.numWorkers = size;
  store_options.waitWorkers = true;
  auto store = c10::make_intrusive<c10d::TCPStore>(spec.rendezvous.host, store_options);
  auto gloo_options = c10d::ProcessGroupGloo::Options::create();
  gloo_options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname(
      spec.local_host.empty() ? "127.0.0.1" : spec.local_host));
  auto raw = c10::make_intrusive<c10d::ProcessGroupGloo>(
      c10::make_intrusive<c10d::PrefixStore>("raw", store), rank, size, gloo_options);

  for (std::int64_t bytes = 4096; bytes <= max_bytes; bytes *= 4) {
    auto tensor = torch::ones({bytes / 4}, torch::kFloat32);
    const int iterations = static_cast<int>(std::clamp<std::int64_t>((128ll << 20) / bytes, 5, 200));
    auto time_flotilla = [&] {
      const auto start = Clock::now();
      for (int i = 0; i < iterations; ++i) comm.all_reduce(tensor).wait();
      return std::chrono::duration<double>(Clock::now() - start).count() / iterations;
    };
    auto time_raw = [&] {
      const auto start = Clock::now();
      for (int i = 0; i < iterations; ++i) {
        std::vector<at::Tensor> tensors{tensor};
        raw->allreduce(tensors)->wait();
      }
      return std::chrono::duration<double>(Clock::now() - start).count() / iterations;
    };
    time_flotilla(); // warm-up: connections, buffers
    time_raw();
    std::vector<double> ours, theirs;
    for (int r = 0; r < rounds; ++r) {
      // Alternate which goes first, so neither always follows the other's cache state.
      if (r % 2 == 0) {
        ours.push_back(time_flotilla());
        theirs.push_back(time_raw());
      } else {
        theirs.push_back(time_raw());
        ours.push_back(time_flotilla());
      }
    }
    // Rank 0 reports rank 0's medians; the ring makes every rank wait for the slowest anyway.
    if (rank != 0) continue;
    const std::string transport = comm.transport(tensor);
    const double factor = 2.0 * (size - 1) / size;
    for (const auto& [name, seconds] :
         {std::pair<const char*, double>{"flotilla", median(ours)}, {"c10d-gloo", median(theirs)}}) {
      std::printf("{\"bench\":\"allreduce\",\"system\":\"%s\",\"transport\":\"%s\","
                  "\"processes\":%d,\"bytes\":%lld,"
                  "\"metric\":\"busbw_GBps\",\"value\":%.4f,\"time_us\":%.1f,\"rounds\":%d,"
                  "\"iterations\":%d}\n",
                  name, name == std::string("flotilla") ? transport.c_str() : "gloo", size,
                  static_cast<long long>(bytes),
                  static_cast<double>(bytes) / seconds * factor / 1e9, seconds * 1e6, rounds,
                  iterations);
    }
    std::printf("{\"bench\":\"allreduce\",\"transport\":\"%s\",\"processes\":%d,\"bytes\":%lld,"
                "\"metric\":\"time\",\"ratio\":%.4f,\"of\":\"flotilla/c10d-gloo\"}\n",
                transport.c_str(), size, static_cast<long long>(bytes), median(ours) / median(theirs));
    std::fflush(stdout);
  }
  return 0;
}
