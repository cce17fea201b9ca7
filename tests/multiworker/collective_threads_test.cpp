#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <thread>
#include <tuple>

#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include <dirent.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "collective/group.h"
#include "collective/shared_memory.h"
#include "flotilla/collective/communicator.h"
#include "flotilla/error.h"
#include "support/ranks.h"

namespace flotilla::collective {
namespace {

using flotilla::testing::run_ranks;

// Rank r's input: element i is (r + 1) * (i % 13 + 1), so every reduction is known in closed form.
torch::Tensor input(int rank, std::int64_t n, torch::ScalarType type = torch::kFloat32) {
  return ((torch::arange(n, torch::kInt64) % 13) + 1).mul(rank + 1).to(type);
}

class Collectives : public ::testing::TestWithParam<std::tuple<int, std::int64_t>> {};

// CommunicationOptions::shared_memory: the ranks (threads of one process here) share this host,
// so CPU all-reduces go through the segment, 4 MiB at a time: 2.5 M floats are three chunks.
TEST(SharedMemory, AllReducesGiveTheClosedFormOnEveryRankInEveryTypeAndOp) {
  auto options = flotilla::testing::test_options();
  options.shared_memory = true;
  for (int world : {2, 3}) {
    const std::int64_t n = 2'500'007;
    const double rank_sum = world * (world + 1) / 2.0;
    run_ranks(
        world,
        [&, world](int rank, Communicator& comm) {
          const auto base = input(0, n);
          auto sum = input(rank, n);
          EXPECT_EQ(comm.transport(sum), "shared memory");
          comm.all_reduce(sum).wait();
          EXPECT_TRUE(torch::equal(sum, base * rank_sum));
          for (auto type : {torch::kFloat64, torch::kBFloat16, torch::kFloat16, torch::kInt32}) {
            auto t = input(rank, 1001, type);
            comm.all_reduce(t).wait();
            EXPECT_TRUE(torch::equal(t, input(0, 1001, type) * static_cast<int>(rank_sum))) << type;
          }
          auto mean = input(rank, 7, torch::kFloat64);
          comm.all_reduce(mean, ReduceOp::kMean).wait();
          EXPECT_TRUE(torch::allclose(mean, input(0, 7, torch::kFloat64) * rank_sum / world));
          auto max = input(rank, n, torch::kInt64);
          auto min = input(rank, n);
          comm.all_reduce(max, ReduceOp::kMax).wait();
          comm.all_reduce(min, ReduceOp::kMin).wait();
          EXPECT_TRUE(torch::equal(max, base.to(torch::kInt64) * world));
          EXPECT_TRUE(torch::equal(min, base));
          // A strided view is reduced in a contiguous copy and written back.
          auto wide = input(rank, 40).view({8, 5});
          auto column = wide.select(1, 2);
          comm.all_reduce(column).wait();
          EXPECT_TRUE(torch::equal(column, input(0, 40).view({8, 5}).select(1, 2) * rank_sum));
          EXPECT_TRUE(torch::equal(wide.select(1, 1), input(rank, 40).view({8, 5}).select(1, 1)));
          // Every rank holds the same bits of a sum that rounds (0.1 + 0.2 + ...).
          auto odd = torch::full({3}, 0.1 * (rank + 1), torch::kFloat32);
          comm.all_reduce(odd).wait();
          auto all = comm.all_gather(odd);
          all.wait();
          for (const auto& other : all.result()) EXPECT_TRUE(torch::equal(other, odd));
        },
        options);
  }
}

// The names in /dev/shm that start with `prefix`.
std::vector<std::string> shm_names(const std::string& prefix) {
  std::vector<std::string> names;
  if (DIR* dir = ::opendir("/dev/shm")) {
    while (const dirent* e = ::readdir(dir)) {
      if (std::string(e->d_name).rfind(prefix, 0) == 0) names.push_back(e->d_name);
    }
    ::closedir(dir);
  }
  return names;
}

bool shm_exists(const std::string& name) {
  return ::access(("/dev/shm/" + name).c_str(), F_OK) == 0;
}

std::string pid_namespace() {
  char link[64] = {};
  (void)!::readlink("/proc/self/ns/pid", link, sizeof link - 1);
  std::string digits;
  for (const char* c = link; *c; ++c) {
    if (*c >= '0' && *c <= '9') digits += *c;
  }
  return digits;
}

// Rank 0 made the segment, then a rank never said it mapped it (it died): the wait for it fails,
// and the segment's name goes with it instead of staying in /dev/shm.
TEST(SharedMemory, ASegmentWhoseRankNeverMappedItLeavesNothingInDevShm) {
  const auto before = shm_names("flotilla-");
  auto store = c10::make_intrusive<c10d::HashStore>();
  store->setTimeout(std::chrono::milliseconds(500));
  std::thread peer([&] { // says it shares this host, then nothing more
    store->set("host/1", store->get("host/0"));
  });
  std::string why;
  EXPECT_ANY_THROW(detail::SharedMemoryReduce::open(*store, 0, 2, why));
  peer.join();
  EXPECT_FALSE(store->get("name").empty()); // it was made
  EXPECT_EQ(shm_names("flotilla-"), before);
}

// A non-zero rank maps only a segment of its own user that nobody else may read or write, as rank
// 0 makes it: not one another user owns, nor one with a wider mode (it checked the size alone).
TEST(SharedMemory, ANonZeroRankRefusesASegmentOfAnotherOwnerOrAWiderMode) {
  for (const auto& [uid, mode, seen] :
       {std::tuple<uid_t, mode_t, std::string>{65534, 0600, "belongs to uid 65534 with mode 0600"},
        std::tuple<uid_t, mode_t, std::string>{::geteuid(), 0666,
                                               "belongs to uid " + std::to_string(::geteuid()) +
                                                   " with mode 0666"}}) {
    const std::string name = "/flotilla-test-" + std::to_string(::getpid()) + "-owner";
    const int fd = ::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(::fchmod(fd, mode), 0);
    if (uid != ::geteuid() && ::fchown(fd, uid, static_cast<gid_t>(-1)) != 0) {
      ::close(fd);
      ::shm_unlink(name.c_str());
      GTEST_SKIP() << "cannot give a segment to another user (not root)";
    }
    ::close(fd);
    auto store = c10::make_intrusive<c10d::HashStore>();
    store->setTimeout(std::chrono::seconds(5));
    std::string why;
    std::thread zero([&] { // rank 0 as the store shows it: this host, that segment, mapped
      store->set("host/0", store->get("host/1"));
      store->set("name", std::vector<std::uint8_t>(name.begin(), name.end()));
      store->set("ok/0", std::vector<std::uint8_t>{'1'});
    });
    EXPECT_EQ(detail::SharedMemoryReduce::open(*store, 1, 2, why), nullptr);
    zero.join();
    ::shm_unlink(name.c_str());
    EXPECT_NE(why.find("rank 1: the segment " + name + " is not rank 0's: it " + seen), std::string::npos)
        << why;
  }
}

// A rank 0 killed before it unlinked its segment leaves it behind: the next rank 0 of this user
// and PID namespace removes it once its process no longer runs, and nothing else.
TEST(SharedMemory, TheNextGroupRemovesASegmentLeftByAKilledRankZeroAndNothingElse) {
  const pid_t child = ::fork();
  if (child == 0) ::_exit(0);
  ASSERT_GT(child, 0);
  ASSERT_EQ(::waitpid(child, nullptr, 0), child); // a pid that no longer runs
  const std::string ns = pid_namespace();
  const std::string orphan = "flotilla-" + ns + "-" + std::to_string(child) + "-0123456789abcdef";
  const std::vector<std::string> kept = {
      "flotilla-" + ns + "-" + std::to_string(::getpid()) + "-0123456789abcdef", // runs
      "flotilla-1-" + std::to_string(child) + "-0123456789abcdef",           // another namespace
      "flotilla-" + ns + "-" + std::to_string(child) + "-notanonce",         // not flotilla's name
      "flotilla-" + ns + "-" + std::to_string(child) + "-0123456789abcdef0", // nor this
  };
  for (const auto& name : kept) ASSERT_FALSE(shm_exists(name)) << name;
  std::vector<std::string> made = kept;
  made.push_back(orphan);
  for (const auto& name : made) {
    const int fd = ::shm_open(("/" + name).c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    ASSERT_GE(fd, 0) << name;
    ::close(fd);
  }
  auto store = c10::make_intrusive<c10d::HashStore>();
  store->setTimeout(std::chrono::seconds(30));
  std::unique_ptr<detail::SharedMemoryReduce> reduce[2];
  std::string why[2];
  std::thread one([&] { reduce[1] = detail::SharedMemoryReduce::open(*store, 1, 2, why[1]); });
  reduce[0] = detail::SharedMemoryReduce::open(*store, 0, 2, why[0]);
  one.join();
  EXPECT_NE(reduce[0], nullptr) << why[0];
  EXPECT_NE(reduce[1], nullptr) << why[1];
  EXPECT_FALSE(shm_exists(orphan));
  ::shm_unlink(("/" + orphan).c_str()); // when it failed
  for (const auto& name : kept) {
    EXPECT_TRUE(shm_exists(name)) << name;
    ::shm_unlink(("/" + name).c_str());
  }
}

TEST_P(Collectives, AllReduceBroadcastGatherGiveTheClosedFormOnEveryRank) {
  const auto [world, n] = GetParam();
  const double rank_sum = world * (world + 1) / 2.0; // sum of (r + 1)
  run_ranks(world, [&, world = world, n = n](int rank, Communicator& comm) {
    EXPECT_EQ(comm.rank(), rank);
    EXPECT_EQ(comm.size(), world);
    const auto base = input(0, n); // (i % 13 + 1)

    auto sum = input(rank, n);
    comm.all_reduce(sum, ReduceOp::kSum).wait();
    EXPECT_TRUE(torch::allclose(sum, base * rank_sum));

    auto mean = input(rank, n, torch::kFloat64);
    comm.all_reduce(mean, ReduceOp::kMean).wait();
    EXPECT_TRUE(torch::allclose(mean, base.to(torch::kFloat64) * rank_sum / world));

    auto max = input(rank, n);
    auto min = input(rank, n);
    auto w1 = comm.all_reduce(max, ReduceOp::kMax);
    auto w2 = comm.all_reduce(min, ReduceOp::kMin); // two in flight at once
    w2.wait();
    w1.wait();
    EXPECT_TRUE(torch::equal(max, base * world));
    EXPECT_TRUE(torch::equal(min, base));

    auto ints = input(rank, n, torch::kInt64);
    comm.all_reduce(ints).wait();
    EXPECT_TRUE(torch::equal(ints, base.to(torch::kInt64) * static_cast<std::int64_t>(rank_sum)));

    for (int root = 0; root < world; ++root) {
      auto b = input(rank, n);
      comm.broadcast(b, root).wait();
      EXPECT_TRUE(torch::equal(b, input(root, n))) << "root " << root;
    }

    auto gather = comm.all_gather(input(rank, n));
    gather.wait();
    ASSERT_EQ(gather.result().size(), static_cast<std::size_t>(world));
    for (int r = 0; r < world; ++r) EXPECT_TRUE(torch::equal(gather.result()[r], input(r, n)));

    comm.barrier().wait();
  });
}

INSTANTIATE_TEST_SUITE_P(WorldsAndSizes, Collectives,
                         ::testing::Combine(::testing::Values(1, 2, 3, 4),
                                            ::testing::Values(0, 1, 7, (1 << 20) + 3)),
                         [](const auto& info) {
                           return "world" + std::to_string(std::get<0>(info.param)) + "_n" +
                                  std::to_string(std::get<1>(info.param));
                         });

TEST(Collectives, AMeanIsFinalOnceCompletedEvenWithoutWait) {
  run_ranks(2, [](int rank, Communicator& comm) {
    auto t = torch::full({1000}, static_cast<double>(rank + 1));
    auto work = comm.all_reduce(t, ReduceOp::kMean);
    while (!work.is_completed()) std::this_thread::yield();
    EXPECT_TRUE(torch::equal(t, torch::full({1000}, 1.5))); // divided, not the raw sum 3
    work.wait();
    EXPECT_TRUE(torch::equal(t, torch::full({1000}, 1.5))); // and only once
  });
}

TEST(Collectives, StridedTensorsAreReducedInPlace) {
  run_ranks(2, [](int rank, Communicator& comm) {
    auto matrix = torch::full({4, 6}, static_cast<float>(rank + 1));
    auto column = matrix.select(1, 2); // a strided view
    ASSERT_FALSE(column.is_contiguous());
    comm.all_reduce(column, ReduceOp::kSum).wait();
    EXPECT_TRUE(torch::equal(matrix.select(1, 2), torch::full({4}, 3.0f)));
    EXPECT_TRUE(torch::equal(matrix.select(1, 1), torch::full({4}, static_cast<float>(rank + 1))));
  });
}

TEST(Collectives, MeanOfIntegersIsRefused) {
  run_ranks(1, [](int, Communicator& comm) {
    auto t = torch::ones({3}, torch::kInt64);
    try {
      comm.all_reduce(t, ReduceOp::kMean);
      FAIL();
    } catch (const ConfigError& e) {
      EXPECT_EQ(std::string(e.what()),
                "all_reduce #1 (mean, 3 x long): a mean of integer values would be "
                "truncated; use ReduceOp::kSum and divide in floating point");
    }
  });
}

TEST(Collectives, BadRootIsRefused) {
  run_ranks(1, [](int, Communicator& comm) {
    EXPECT_THROW(comm.broadcast(torch::ones({1}), 1), ConfigError);
  });
}

TEST(Collectives, AMissingRankTimesOutNamingTheOperation) {
  CommunicationOptions options;
  options.timeout = std::chrono::milliseconds(1500);
  run_ranks(
      2,
      [](int rank, Communicator& comm) {
        auto t = torch::ones({16});
        comm.all_reduce(t).wait(); // #1 completes
        if (rank == 1) {
          // Rank 1 never issues #2; it waits until rank 0 has given up.
          std::this_thread::sleep_for(std::chrono::milliseconds(3000));
          return;
        }
        const auto start = std::chrono::steady_clock::now();
        auto work = comm.all_reduce(t);
        std::string first;
        try {
          work.wait();
          FAIL() << "a collective with a missing rank completed";
        } catch (const TimeoutError& e) {
          first = e.what();
        }
        try {
          work.wait(); // a failed Work rethrows the same failure
          FAIL();
        } catch (const TimeoutError& e) {
          EXPECT_EQ(std::string(e.what()), first);
          const std::string message = e.what();
          EXPECT_EQ(message.rfind("all_reduce #2 (sum, 16 x float) on rank 0 of 2 did not complete "
                                  "within 1500ms (",
                                  0),
                    0u)
              << message;
          EXPECT_NE(message.find("rank 1 did not arrive (no word from it"), std::string::npos)
              << message;
          const std::string advice =
              "; check the other workers' output, or raise CommunicationOptions::timeout";
          EXPECT_EQ(message.substr(message.size() - std::min(message.size(), advice.size())),
                    advice)
              << message;
        }
        (void)start;
      },
      options);
}

TEST(Collectives, APeerThatLeavesFailsTheCollectiveWithCommError) {
  CommunicationOptions options;
  options.timeout = std::chrono::seconds(20);
  auto comms = Communicator::local_group(2, options);
  auto t = torch::ones({8});
  comms[1] = comms[0]; // drops rank 1's only handle: its connections close
  try {
    comms[0].all_reduce(t).wait();
    FAIL() << "completed without its peer";
  } catch (const TimeoutError& e) {
    FAIL() << "waited for the timeout instead of noticing the closed connection: " << e.what();
  } catch (const CommError& e) {
    const std::string message = e.what();
    EXPECT_EQ(message.rfind("all_reduce #1 (sum, 8 x float) on rank 0 of 2 failed (", 0), 0u)
        << message;
    EXPECT_NE(message.find("a peer probably exited"), std::string::npos) << message;
  }
}

// Fencing (detail::sever_group): ranks 0 and 1 are inside an all-reduce that rank 2 has not
// joined, and give the group up as an elastic generation is given up. Rank 2, late (a member that
// was stopped, woken), must not complete that all-reduce against their abandoned work: it fails
// on the reset pairs. Without the reset, their Gloo threads were still waiting for its data and
// the all-reduce completed on rank 2 with the sum 6.
TEST(Collectives, ALateRanksAllReduceFailsOnceTheOthersSeveredTheGroup) {
  CommunicationOptions options;
  options.shared_memory = false;
  options.timeout = std::chrono::seconds(2);
  c10::intrusive_ptr<c10d::Store> store = c10::make_intrusive<c10d::HashStore>();
  std::vector<std::optional<Communicator>> groups(3);
  {
    std::vector<std::thread> threads;
    for (int r = 0; r < 3; ++r) {
      threads.emplace_back([&, r] {
        groups[r] = detail::make_group(r, 3, options, store, "127.0.0.1",
                                       {"rank 0", "rank 1", "rank 2"}, detail::new_health());
      });
    }
    for (auto& t : threads) t.join();
  }
  std::vector<at::Tensor> values;
  std::vector<Work> works;
  for (int r = 0; r < 2; ++r) {
    values.push_back(torch::full({1000}, static_cast<float>(r + 1)));
    works.push_back(groups[r]->all_reduce(values.back()));
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(300)); // theirs are sent and waiting
  detail::sever_group(*groups[0]);
  detail::sever_group(*groups[1]);
  auto late = torch::full({1000}, 3.0f);
  try {
    groups[2]->all_reduce(late).wait();
    FAIL() << "the late rank completed an all-reduce the others had given up: sum "
           << late[0].item<float>();
  } catch (const CommError& e) {
    EXPECT_NE(std::string(e.what()).find("Connection reset by peer"), std::string::npos)
        << e.what();
  }
  // Theirs fail too (by their timeout: nothing wakes a wait this process abandoned).
  for (auto& work : works) EXPECT_THROW(work.wait(), CommError);
}

TEST(Communication, ABadHeartbeatOrAnEmptyTokenIsRefusedNamingTheField) {
  const auto spec = flotilla::testing::thread_cluster(0, 2);
  CommunicationOptions options;
  options.heartbeat_interval = std::chrono::seconds(0);
  try {
    Communicator::connect(spec, options);
    FAIL() << "no error";
  } catch (const ConfigError& e) {
    EXPECT_EQ(std::string(e.what()),
              "the heartbeat needs 0 < CommunicationOptions::heartbeat_interval < "
              "CommunicationOptions::heartbeat_timeout; saw 0 s and 10 s");
  }
  options = CommunicationOptions();
  options.cluster_token = "";
  try {
    Communicator::connect(spec, options);
    FAIL() << "no error";
  } catch (const ConfigError& e) {
    EXPECT_EQ(std::string(e.what()),
              "CommunicationOptions::cluster_token is empty; set a long random secret (e.g. "
              "openssl rand -hex 32) or leave it unset");
  }
}

TEST(Communication, ImplementationNames) {
  EXPECT_EQ(parse_implementation("Ring"), Implementation::kRing);
  EXPECT_EQ(parse_implementation("AUTO"), Implementation::kAuto);
  EXPECT_EQ(parse_implementation("nccl"), Implementation::kNccl);
  try {
    parse_implementation("mpi");
    FAIL();
  } catch (const ConfigError& e) {
    EXPECT_EQ(std::string(e.what()),
              "communication implementation \"mpi\" is unknown; use AUTO, RING or NCCL");
  }
}

} // namespace
} // namespace flotilla::collective
