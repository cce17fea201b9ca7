// bench/scale.cpp replays the address exchange of Gloo's process groups against the rendezvous
// instead of connecting them (it simulates 1024 members in one process). The replay is only as
// good as its likeness: here it is checked against what Gloo itself asks of the store, request
// by request, in each of the three ways Gloo can exchange addresses (flotilla's groups use the
// third, kBatched).
#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include <algorithm>
#include <optional>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "collective/group.h"
#include "scale_exchange.h"

namespace flotilla {
namespace {

using bench::GlooExchange;

std::vector<std::string> sorted(std::vector<std::string> lines) {
  std::sort(lines.begin(), lines.end());
  return lines;
}

// Every rank's requests to the store while `size` ranks form a group: through flotilla's own
// make_group (Gloo only: no shared memory), or through the replay.
std::vector<std::string> requests(int size, bool real, GlooExchange exchange) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  bench::StoreTally tally;
  tally.log = true;
  collective::CommunicationOptions options;
  options.shared_memory = false;
  options.timeout = std::chrono::seconds(30);
  std::vector<std::thread> ranks;
  std::vector<std::optional<collective::Communicator>> groups(size);
  for (int r = 0; r < size; ++r) {
    ranks.emplace_back([&, r] {
      auto counted = c10::make_intrusive<bench::CountingStore>(store, tally);
      if (real) {
        groups[r] = collective::detail::make_group(r, size, options, counted, "127.0.0.1", {},
                                                   collective::detail::new_health());
      } else {
        bench::replay_gloo_exchange(counted, r, size, exchange, options.timeout);
      }
    });
  }
  for (auto& t : ranks) t.join();
  return sorted(tally.lines);
}

// Sets an environment variable for a scope, and puts it back.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    const char* before = std::getenv(name);
    if (before) saved_ = before;
    ::setenv(name, value, 1);
  }
  ~ScopedEnv() {
    if (saved_) {
      ::setenv(name_, saved_->c_str(), 1);
    } else {
      ::unsetenv(name_);
    }
  }

 private:
  const char* name_;
  std::optional<std::string> saved_;
};

TEST(ScaleExchange, TheReplayAsksTheStoreWhatGlooAsksRequestByRequest) {
  for (const auto exchange : {GlooExchange::kPairIdentifiers, GlooExchange::kRankAsSequence,
                              GlooExchange::kBatched}) {
    ScopedEnv rank("GLOO_ENABLE_RANK_AS_SEQUENCE_NUMBER",
                   exchange == GlooExchange::kPairIdentifiers ? "0" : "1");
    ScopedEnv v2("GLOO_ENABLE_STORE_V2_API", exchange == GlooExchange::kBatched ? "1" : "0");
    const auto gloo = requests(3, /*real=*/true, exchange);
    const auto replay = requests(3, /*real=*/false, exchange);
    EXPECT_EQ(replay, gloo);
    // 3 sets, and 9 waits and 9 gets or 3 multiGets; each record 8 bytes longer per rank with
    // pair identifiers.
    ASSERT_EQ(gloo.size(), exchange == GlooExchange::kBatched ? 6u : 21u);
  }
  // The records' sizes differ by the pair identifiers (3 ranks: 24 bytes).
  EXPECT_EQ(bench::gloo_rank_record(3, GlooExchange::kPairIdentifiers).size() -
                bench::gloo_rank_record(3, GlooExchange::kRankAsSequence).size(),
            24u);
}

} // namespace
} // namespace flotilla
