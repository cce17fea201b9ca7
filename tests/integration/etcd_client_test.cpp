// flotilla's etcd client (collective/etcd.h) against a real etcd (Debian's etcd-server, one
// member on loopback): the calls the replicated rendezvous makes, what a lost lease or a dead
// endpoint looks like. Skipped without the etcd binary.
#include "collective/etcd.h"

#include <gtest/gtest.h>

#include <thread>

#include "flotilla/error.h"
#include "support/paths.h"
#include "support/subprocess.h"

namespace flotilla::collective::detail {
namespace {

using testing::Process;

bool have_etcd() {
  return std::system("command -v etcd >/dev/null 2>&1") == 0;
}

// One etcd member on loopback, on free ports, its data in a directory of its own; stopped and
// removed with this object.
struct LocalEtcd {
  std::vector<int> ports = testing::free_ports(2); // client, peer
  testing::TempDir dir;
  Process process = start();
  int client_port() const { return ports[0]; }

 private:
  Process start() {
    const std::string client = "http://127.0.0.1:" + std::to_string(ports[0]);
    const std::string peer = "http://127.0.0.1:" + std::to_string(ports[1]);
    return Process({"etcd", "--name", "t", "--data-dir", dir.path() + "/data",
                    "--listen-client-urls", client, "--advertise-client-urls", client,
                    "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                    "--initial-cluster", "t=" + peer});
  }
};

TEST(Etcd, Base64IsRfc4648) {
  EXPECT_EQ(base64(""), "");
  EXPECT_EQ(base64("f"), "Zg==");
  EXPECT_EQ(base64("fo"), "Zm8=");
  EXPECT_EQ(base64("foo"), "Zm9v");
  EXPECT_EQ(base64(std::string("\0\xff", 2)), "AP8=");
  for (const std::string& s : {std::string(), std::string("f"), std::string("fo"),
                               std::string("/flotilla/job/rendezvous"), std::string("\0\xff", 2)}) {
    EXPECT_EQ(unbase64(base64(s)), s);
  }
  EXPECT_EQ(unbase64("Zm9"), std::nullopt);  // not a multiple of 4
  EXPECT_EQ(unbase64("Zm9*"), std::nullopt); // not the alphabet
}

TEST(Etcd, TheRendezvousCallsWorkAgainstARealEtcdAndSkipADeadEndpoint) {
  if (!have_etcd()) GTEST_SKIP() << "etcd is not installed (apt install etcd-server)";
  LocalEtcd etcd;
  const int dead = testing::free_ports(1)[0];
  // The first endpoint has nothing behind it: every call goes on to the second.
  EtcdClient c({{"127.0.0.1", dead}, {"127.0.0.1", etcd.client_port()}}, std::chrono::seconds(2));
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  std::optional<std::int64_t> lease;
  while (!lease) {
    try {
      lease = c.grant(5);
    } catch (const CommError& e) {
      ASSERT_LT(std::chrono::steady_clock::now(), deadline) << e.what() << etcd.process.errors_so_far();
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
    }
  }
  const std::string key = "/flotilla/test/rendezvous";
  EXPECT_EQ(c.get(key), std::nullopt);
  EXPECT_TRUE(c.create(key, "10.0.0.9:29400", *lease));
  EXPECT_EQ(c.get(key), "10.0.0.9:29400");
  const std::int64_t other = c.grant(5);
  EXPECT_FALSE(c.create(key, "10.0.0.8:29400", other)); // taken: the first one stays
  EXPECT_EQ(c.get(key), "10.0.0.9:29400");
  EXPECT_TRUE(c.holds(key, *lease));
  EXPECT_FALSE(c.holds(key, other));
  const std::int64_t left = c.keep_alive(*lease);
  EXPECT_GE(left, 4);
  EXPECT_LE(left, 5);
  c.revoke(*lease); // its key goes with it
  EXPECT_EQ(c.get(key), std::nullopt);
  EXPECT_EQ(c.keep_alive(*lease), 0);
  EXPECT_TRUE(c.create(key, "10.0.0.8:29400", other));

  etcd.process.signal(SIGKILL);
  etcd.process.wait();
  try {
    c.get(key);
    ADD_FAILURE() << "no error with every endpoint down";
  } catch (const CommError& e) {
    const std::string what = e.what();
    EXPECT_EQ(what.rfind("no etcd endpoint answered /v3/kv/range (", 0), 0u) << what;
    EXPECT_NE(what.find("127.0.0.1:" + std::to_string(dead) + ": "), std::string::npos) << what;
    EXPECT_NE(what.find("127.0.0.1:" + std::to_string(etcd.client_port()) + ": "), std::string::npos) << what;
  }
}

// A fixed group (no --elastic) meeting through FLOTILLA_RENDEZVOUS=etcd://: the workers find the
// replica etcd names and train; the same path the elastic netns test takes, on loopback.
TEST(Etcd, AFixedGroupMeetsThroughTheReplicaEtcdNames) {
  if (!have_etcd()) GTEST_SKIP() << "etcd is not installed (apt install etcd-server)";
  if (!testing::fashion_mnist_present()) GTEST_SKIP() << "no Fashion-MNIST";
  LocalEtcd etcd;
  const auto ports = testing::free_ports(3); // the replica's, the two workers'
  const std::string url = "etcd://127.0.0.1:" + std::to_string(etcd.client_port()) + "/fixed";
  const std::string cli = testing::flotilla_cli();
  Process replica({cli, "rendezvous", "--fixed", "--workers", "2", "--listen",
                   "127.0.0.1:" + std::to_string(ports[0]), "--etcd", url});
  ASSERT_TRUE(replica.wait_for_output("serving job \"fixed\"", std::chrono::seconds(30)))
      << replica.output_so_far() << replica.errors_so_far() << etcd.process.errors_so_far();
  const std::string cluster = R"({"cluster":{"worker":["127.0.0.1:)" + std::to_string(ports[1]) +
                              R"(","127.0.0.1:)" + std::to_string(ports[2]) + R"("]},)";
  std::vector<std::unique_ptr<Process>> workers;
  for (int i = 0; i < 2; ++i) {
    workers.push_back(std::make_unique<Process>(
        std::vector<std::string>{cli, "train", "--model", "mlp", "--epochs", "1",
                                 "--steps-per-epoch", "3", "--batch-per-replica", "16", "--threads",
                                 "1", "--verbose", "0"},
        std::map<std::string, std::string>{
            {"TF_CONFIG",
             cluster + R"("task":{"type":"worker","index":)" + std::to_string(i) + "}}"},
            {"FLOTILLA_RENDEZVOUS", url}}));
  }
  for (auto& w : workers) {
    const auto r = w->wait(std::chrono::seconds(120));
    EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
  }
}

} // namespace
} // namespace flotilla::collective::detail
