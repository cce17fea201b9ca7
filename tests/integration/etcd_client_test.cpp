// flotilla's etcd client (collective/etcd.h) against a real etcd (Debian's etcd-server, one
// member on loopback): the calls the replicated rendezvous makes, what a lost lease or a dead
// endpoint looks like. Skipped without the etcd binary.
#include "rendezvous/etcd.h"

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
// removed with this object. With `certificates` (a directory of tests/support/etcd_certs.sh's):
// TLS on its client port, and only clients with a certificate its CA signed.
struct LocalEtcd {
  explicit LocalEtcd(std::string certificates = "") : certs(std::move(certificates)) {}
  std::string certs;
  std::vector<int> ports = testing::free_ports(2); // client, peer
  testing::TempDir dir;
  Process process = start();
  int client_port() const { return ports[0]; }
  cluster::Address client() const { return {"127.0.0.1", ports[0]}; }

 private:
  Process start() {
    const std::string client = (certs.empty() ? "http" : "https") + std::string("://127.0.0.1:") +
                               std::to_string(ports[0]);
    const std::string peer = "http://127.0.0.1:" + std::to_string(ports[1]);
    std::vector<std::string> argv = {
        "etcd", "--name", "t", "--data-dir", dir.path() + "/data", "--listen-client-urls", client,
        "--advertise-client-urls", client, "--listen-peer-urls", peer,
        "--initial-advertise-peer-urls", peer, "--initial-cluster", "t=" + peer};
    if (!certs.empty()) {
      for (const std::string& a : {"--cert-file=" + certs + "/server.pem",
                                   "--key-file=" + certs + "/server.key",
                                   "--trusted-ca-file=" + certs + "/ca.pem",
                                   std::string("--client-cert-auth")}) {
        argv.push_back(a);
      }
    }
    return Process(argv);
  }
};

cluster::EtcdRendezvous plain(std::vector<cluster::Address> endpoints) {
  cluster::EtcdRendezvous etcd;
  etcd.endpoints = std::move(endpoints);
  etcd.job = "test";
  return etcd;
}

// A lease, asked for until etcd has started (30 s at most).
std::int64_t first_lease(EtcdClient& c, const LocalEtcd& etcd) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  for (;;) {
    try {
      return c.grant(5);
    } catch (const CommError& e) {
      if (std::chrono::steady_clock::now() > deadline) {
        ADD_FAILURE() << e.what() << etcd.process.errors_so_far();
        throw;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
    }
  }
}

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
  EtcdClient c(plain({{"127.0.0.1", dead}, etcd.client()}), std::chrono::seconds(2));
  const std::optional<std::int64_t> lease = first_lease(c, etcd);
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

  // TLS against this plain-HTTP etcd: refused at once, saying so, not retried until a timeout.
  cluster::EtcdRendezvous tls = plain({etcd.client()});
  tls.tls = true;
  EtcdClient secure(tls, std::chrono::seconds(2));
  try {
    secure.get(key);
    ADD_FAILURE() << "TLS against plain HTTP answered";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find(": no TLS there ("), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("write etcd:// for plain HTTP"), std::string::npos)
        << e.what();
  }

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

bool have_openssl() {
  return std::system("command -v openssl >/dev/null 2>&1") == 0;
}

// tests/support/etcd_certs.sh's certificates for 127.0.0.1 (copied beside the test programs).
void make_certificates(const std::string& dir) {
  const std::string command =
      testing::test_bin_dir() + "/etcd_certs.sh " + dir + " 127.0.0.1 >/dev/null 2>&1";
  ASSERT_EQ(std::system(command.c_str()), 0) << command;
}

// etcd's authentication on: the root user, and the user trainer (password trainerpw) whose role
// may read and write the keys under /flotilla/<job>/ and nothing else.
void enable_authentication(const LocalEtcd& etcd, const std::string& job) {
  const std::string etcdctl = "ETCDCTL_API=3 etcdctl --endpoints https://127.0.0.1:" +
                              std::to_string(etcd.client_port()) + " --cacert " + etcd.certs +
                              "/ca.pem --cert " + etcd.certs + "/client.pem --key " + etcd.certs +
                              "/client.key ";
  for (const std::string& command : std::vector<std::string>{
           "user add root:rootpw --interactive=false", "user grant-role root root",
           "role add trainer",
           "role grant-permission trainer --prefix=true readwrite /flotilla/" + job + "/",
           "user add trainer:trainerpw --interactive=false", "user grant-role trainer trainer",
           "auth enable"}) {
    ASSERT_EQ(std::system((etcdctl + command + " >/dev/null 2>&1").c_str()), 0) << command;
  }
}

// A client of etcd with TLS: its CA, certificate and key by their names in `certs` ("" for none).
cluster::EtcdRendezvous secured(const LocalEtcd& etcd, const std::string& ca,
                                const std::string& cert, const std::string& key) {
  cluster::EtcdRendezvous e = plain({etcd.client()});
  e.tls = true;
  const auto path = [&](const std::string& name) { return name.empty() ? "" : etcd.certs + "/" + name; };
  e.ca_file = path(ca);
  e.cert_file = path(cert);
  e.key_file = path(key);
  return e;
}

// What a lookup through `etcd` is refused with: a ConfigError's message (anything else says so).
std::string refusal(const cluster::EtcdRendezvous& etcd) {
  EtcdClient c(etcd, std::chrono::seconds(5));
  try {
    c.get(etcd.key());
  } catch (const ConfigError& e) {
    return e.what();
  } catch (const Error& e) {
    return std::string("not a ConfigError: ") + e.what();
  }
  return "no error";
}

#define EXPECT_HAS(text, part) EXPECT_NE((text).find(part), std::string::npos) << (text)

// etcd as production runs it: TLS with client certificates, and its own users with roles. What
// it refuses is a ConfigError at once (exit 2 in the CLI), naming what is wrong.
TEST(Etcd, ASecuredEtcdServesTrustedClientsAndUsersWithinTheirRoleAndRefusesTheRest) {
  if (!have_etcd() || !have_openssl()) GTEST_SKIP() << "needs etcd-server and openssl";
  testing::TempDir certs;
  make_certificates(certs.path());
  LocalEtcd etcd(certs.path());
  EtcdClient trusted(secured(etcd, "ca.pem", "client.pem", "client.key"), std::chrono::seconds(5));
  trusted.revoke(first_lease(trusted, etcd));

  EXPECT_HAS(refusal(secured(etcd, "ca.pem", "", "")), "refused this client in the TLS handshake");
  EXPECT_HAS(refusal(secured(etcd, "ca.pem", "stranger.pem", "stranger.key")),
             "refused this client in the TLS handshake");
  EXPECT_HAS(refusal(secured(etcd, "other-ca.pem", "client.pem", "client.key")),
             "its certificate does not verify");
  EXPECT_HAS(refusal(plain({etcd.client()})), "it speaks TLS there; write etcds://");

  enable_authentication(etcd, "secure");
  const auto as = [&](const std::string& user, const std::string& password, const std::string& job) {
    cluster::EtcdRendezvous e = secured(etcd, "ca.pem", "client.pem", "client.key");
    e.user = user;
    e.password = password;
    e.job = job;
    return e;
  };
  EtcdClient job(as("trainer", "trainerpw", "secure"), std::chrono::seconds(5));
  const std::string key = "/flotilla/secure/rendezvous";
  const std::int64_t lease = job.grant(5);
  EXPECT_TRUE(job.create(key, "10.0.0.9:29400", lease));
  EXPECT_EQ(job.get(key), "10.0.0.9:29400");
  EXPECT_TRUE(job.holds(key, lease));
  EXPECT_GE(job.keep_alive(lease), 4);
  job.revoke(lease);
  EXPECT_EQ(job.get(key), std::nullopt);

  EXPECT_HAS(refusal(as("trainer", "wrong", "secure")), "check the etcd user");
  EXPECT_HAS(refusal(as("", "", "secure")), "this etcd requires authentication");
  EXPECT_HAS(refusal(as("trainer", "trainerpw", "other")), "may not read and write this job's keys");
  cluster::EtcdRendezvous named = as("trainer", "trainerpw", "secure");
  named.cert_file = certs.path() + "/named.pem";
  named.key_file = certs.path() + "/named.key";
  EXPECT_HAS(refusal(named), "refuses a client certificate that has a Common Name");
}

// A fixed group (no --elastic) meeting through FLOTILLA_RENDEZVOUS=etcds://, with TLS client
// certificates and an etcd user limited to the job's keys: the workers find the replica etcd
// names and train; the same path the elastic netns test takes, on loopback. A replica and a worker
// that etcd refuses exit 2 saying why, at once.
TEST(Etcd, AFixedGroupMeetsThroughTheReplicaASecuredEtcdNames) {
  if (!have_etcd() || !have_openssl()) GTEST_SKIP() << "needs etcd-server and openssl";
  if (!testing::fashion_mnist_present()) GTEST_SKIP() << "no Fashion-MNIST";
  testing::TempDir certs;
  make_certificates(certs.path());
  LocalEtcd etcd(certs.path());
  {
    EtcdClient c(secured(etcd, "ca.pem", "client.pem", "client.key"), std::chrono::seconds(5));
    c.revoke(first_lease(c, etcd));
  }
  enable_authentication(etcd, "fixed");
  const auto ports = testing::free_ports(3); // the replica's, the two workers'
  const std::string url = "etcds://127.0.0.1:" + std::to_string(etcd.client_port()) + "/fixed";
  const std::string cli = testing::flotilla_cli();
  const std::string c = certs.path();
  const std::map<std::string, std::string> password = {{"FLOTILLA_ETCD_PASSWORD", "trainerpw"}};
  const auto replica_argv = [&](const std::string& cert) {
    return std::vector<std::string>{
        cli, "rendezvous", "--fixed", "--workers", "2", "--listen",
        "127.0.0.1:" + std::to_string(ports[0]), "--etcd", url, "--etcd-cacert", c + "/ca.pem",
        "--etcd-cert", c + "/" + cert + ".pem", "--etcd-key", c + "/" + cert + ".key",
        "--etcd-user", "trainer"};
  };
  {
    Process stranger(replica_argv("stranger"), password);
    const auto r = stranger.wait(std::chrono::seconds(30));
    EXPECT_EQ(r.exit_code, 2) << r.out << r.err;
    EXPECT_HAS(r.err, "refused this client in the TLS handshake");
  }
  Process replica(replica_argv("client"), password);
  ASSERT_TRUE(replica.wait_for_output("serving job \"fixed\"", std::chrono::seconds(30)))
      << replica.output_so_far() << replica.errors_so_far() << etcd.process.errors_so_far();
  const std::string cluster = R"({"cluster":{"worker":["127.0.0.1:)" + std::to_string(ports[1]) +
                              R"(","127.0.0.1:)" + std::to_string(ports[2]) + R"("]},)";
  const auto worker = [&](int i, const std::string& password) {
    return std::make_unique<Process>(
        std::vector<std::string>{cli, "train", "--model", "mlp", "--epochs", "1",
                                 "--steps-per-epoch", "3", "--batch-per-replica", "16", "--threads",
                                 "1", "--verbose", "0"},
        std::map<std::string, std::string>{
            {"TF_CONFIG",
             cluster + R"("task":{"type":"worker","index":)" + std::to_string(i) + "}}"},
            {"FLOTILLA_RENDEZVOUS", url},
            {"FLOTILLA_ETCD_CACERT", c + "/ca.pem"},
            {"FLOTILLA_ETCD_CERT", c + "/client.pem"},
            {"FLOTILLA_ETCD_KEY", c + "/client.key"},
            {"FLOTILLA_ETCD_USER", "trainer"},
            {"FLOTILLA_ETCD_PASSWORD", password}});
  };
  {
    const auto r = worker(1, "wrong")->wait(std::chrono::seconds(30));
    EXPECT_EQ(r.exit_code, 2) << r.out << r.err;
    EXPECT_HAS(r.err, "check the etcd user");
  }
  std::vector<std::unique_ptr<Process>> workers;
  for (int i = 0; i < 2; ++i) workers.push_back(worker(i, "trainerpw"));
  for (auto& w : workers) {
    const auto r = w->wait(std::chrono::seconds(120));
    EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
  }
}

} // namespace
} // namespace flotilla::collective::detail
