#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>

#include "flotilla/cluster/resolvers.h"
#include "flotilla/error.h"

namespace flotilla::cluster {
namespace {

Environment env(std::map<std::string, std::string> vars) {
  return Environment(std::move(vars));
}

std::string error_of(const Environment& e) {
  try {
    resolve_cluster(e);
  } catch (const ConfigError& error) {
    return error.what();
  }
  return "no error";
}

TEST(Resolvers, NothingSetMeansOneLocalWorker) {
  const auto spec = resolve_cluster(env({}));
  EXPECT_EQ(spec.world_size, 1);
  EXPECT_EQ(spec.rank, 0);
  EXPECT_TRUE(spec.is_chief());
  EXPECT_EQ(spec.source, "single worker");
}

TEST(Resolvers, TfConfigWinsOverTorchrunVariables) {
  const auto spec = resolve_cluster(env({{"TF_CONFIG", R"({"cluster": {"worker": ["a:1", "b:2"]},
                                                          "task": {"type": "worker", "index": 1}})"},
                                         {"RANK", "0"},
                                         {"WORLD_SIZE", "5"}}));
  EXPECT_EQ(spec.source, "TF_CONFIG");
  EXPECT_EQ(spec.rank, 1);
  EXPECT_EQ(spec.world_size, 2);
}

TEST(Resolvers, EmptyTfConfigIsUnset) {
  EXPECT_EQ(resolve_cluster(env({{"TF_CONFIG", ""}})).source, "single worker");
}

// FLOTILLA_RENDEZVOUS=etcd://...: the endpoints and the job, in place of one address.
TEST(Resolvers, AnEtcdRendezvousNamesItsEndpointsAndJob) {
  const std::string tf = R"({"cluster": {"chief": ["a:1"], "worker": ["b:2"]},
                             "task": {"type": "worker", "index": 0}})";
  const auto spec = resolve_cluster(env(
      {{"TF_CONFIG", tf}, {"FLOTILLA_RENDEZVOUS", "etcd://10.0.0.1:2379,[::1]:2380/resnet-1"}}));
  EXPECT_TRUE(spec.external_rendezvous);
  ASSERT_EQ(spec.etcd.endpoints.size(), 2u);
  EXPECT_EQ(spec.etcd.endpoints[0].to_string(), "10.0.0.1:2379");
  EXPECT_EQ(spec.etcd.endpoints[1].to_string(), "[::1]:2380");
  EXPECT_EQ(spec.etcd.job, "resnet-1");
  EXPECT_EQ(spec.etcd.key(), "/flotilla/resnet-1/rendezvous");
  EXPECT_EQ(parse_etcd_rendezvous("etcd://h:2379", "x").job, "flotilla");
  EXPECT_TRUE(resolve_cluster(env({{"TF_CONFIG", tf}, {"FLOTILLA_RENDEZVOUS", "h:29400"}}))
                  .etcd.endpoints.empty());

  const auto error = [](const std::string& text) {
    try {
      parse_etcd_rendezvous(text, "FLOTILLA_RENDEZVOUS");
    } catch (const ConfigError& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  const std::string form = "; write etcd://HOST:PORT,HOST:PORT,...[/JOB] (etcds:// for TLS), e.g. "
                           "etcds://10.0.0.1:2379,10.0.0.2:2379,10.0.0.3:2379/resnet";
  EXPECT_EQ(error("etcd://"), "FLOTILLA_RENDEZVOUS: \"etcd://\" names no endpoint" + form);
  EXPECT_EQ(error("etcd://h:1,"), "FLOTILLA_RENDEZVOUS: \"etcd://h:1,\" ends with a comma" + form);
  EXPECT_EQ(error("etcd://h:1/a b"), "FLOTILLA_RENDEZVOUS: the job \"a b\" in \"etcd://h:1/a b\" "
                                     "must be 1 to 64 letters, digits, '.', '_' or '-'" +
                                         form);
  EXPECT_EQ(error("etcd://h:1/"), "FLOTILLA_RENDEZVOUS: the job \"\" in \"etcd://h:1/\" must be 1 "
                                  "to 64 letters, digits, '.', '_' or '-'" +
                                      form);
  EXPECT_NE(error("etcd://h/job").find("(an etcd endpoint): \"h\" has no port"), std::string::npos)
      << error("etcd://h/job");
  EXPECT_NE(error("http://h:1").find("does not start with etcd:// or etcds://"), std::string::npos);
  EXPECT_FALSE(parse_etcd_rendezvous("etcd://h:1/j", "x").tls);
  EXPECT_TRUE(parse_etcd_rendezvous("etcds://h:1/j", "x").tls);
  EXPECT_EQ(parse_etcd_rendezvous("etcds://h:1,[::1]:2/j", "x").url(), "etcds://h:1,[::1]:2/j");
}

// A secured etcd's files and user, from FLOTILLA_ETCD_* where no flag gave them, each checked
// before anything connects.
TEST(Resolvers, AnEtcdRendezvousTakesItsCertificatesAndUserFromTheEnvironmentAndChecksThem) {
  const std::string pem = ::testing::TempDir() + "/resolvers_test.pem";
  { std::ofstream(pem) << "-----BEGIN CERTIFICATE-----\n"; }
  const std::string tf = R"({"cluster": {"chief": ["a:1"], "worker": ["b:2"]},
                             "task": {"type": "worker", "index": 0}})";
  auto vars = std::map<std::string, std::string>{{"TF_CONFIG", tf},
                                                  {"FLOTILLA_RENDEZVOUS", "etcd://h:2379/j"},
                                                  {"FLOTILLA_ETCD_CACERT", pem},
                                                  {"FLOTILLA_ETCD_CERT", pem},
                                                  {"FLOTILLA_ETCD_KEY", pem},
                                                  {"FLOTILLA_ETCD_USER", "trainer"},
                                                  {"FLOTILLA_ETCD_PASSWORD", "pw"}};
  const auto spec = resolve_cluster(env(vars));
  EXPECT_TRUE(spec.etcd.tls); // a certificate named means TLS, etcd:// or not
  EXPECT_EQ(spec.etcd.ca_file, pem);
  EXPECT_EQ(spec.etcd.key_file, pem);
  EXPECT_EQ(spec.etcd.user, "trainer");
  EXPECT_EQ(spec.etcd.password, "pw");

  // A flag wins over its variable.
  EtcdRendezvous flagged = parse_etcd_rendezvous("etcds://h:2379/j", "--etcd");
  flagged.user = "replica";
  complete_etcd_security(flagged, env(vars));
  EXPECT_EQ(flagged.user, "replica");
  EXPECT_EQ(flagged.password, "pw");

  const auto error = [&](std::map<std::string, std::string> changes) {
    auto v = vars;
    for (const auto& [name, value] : changes) {
      if (value == "-") v.erase(name);
      else v[name] = value;
    }
    try {
      resolve_cluster(env(v));
    } catch (const ConfigError& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_EQ(error({{"FLOTILLA_ETCD_CACERT", "/nonexistent.pem"}}),
            "FLOTILLA_ETCD_CACERT (the CA that signed etcd's certificate) \"/nonexistent.pem\": "
            "No such file or directory; name the PEM file");
  EXPECT_EQ(error({{"FLOTILLA_ETCD_CERT", "/"}}),
            "FLOTILLA_ETCD_CERT (this client's certificate) \"/\" is not a file this process can "
            "read; name the PEM file");
  EXPECT_EQ(error({{"FLOTILLA_ETCD_KEY", "-"}}),
            "FLOTILLA_ETCD_CERT names a certificate without its private key; give --etcd-key or "
            "FLOTILLA_ETCD_KEY too");
  EXPECT_EQ(error({{"FLOTILLA_ETCD_PASSWORD", "-"}}),
            "FLOTILLA_ETCD_USER names the etcd user \"trainer\" without a password; set "
            "FLOTILLA_ETCD_PASSWORD");
  EXPECT_EQ(error({{"FLOTILLA_ETCD_USER", "-"}}),
            "FLOTILLA_ETCD_PASSWORD is set but no etcd user; give --etcd-user or "
            "FLOTILLA_ETCD_USER too");
  EXPECT_EQ(error({{"FLOTILLA_ETCD_CACERT", "-"}, {"FLOTILLA_ETCD_CERT", "-"},
                   {"FLOTILLA_ETCD_KEY", "-"}}),
            "the etcd user \"trainer\" (FLOTILLA_ETCD_USER) would send its password over plain "
            "HTTP to etcd://h:2379/j; write etcds:// (TLS) instead of etcd://");
  std::remove(pem.c_str());
}

// Kubeflow Trainer v2: PET_* read directly when flotilla is the container's command (one process
// per node); under torchrun, its RANK/WORLD_SIZE win.
TEST(Resolvers, KubeflowTrainerPetVariables) {
  const std::map<std::string, std::string> pet = {{"PET_NNODES", "3"},
                                                  {"PET_NPROC_PER_NODE", "1"},
                                                  {"PET_NODE_RANK", "2"},
                                                  {"PET_MASTER_ADDR", "job-node-0-0.job"},
                                                  {"PET_MASTER_PORT", "29500"}};
  const auto spec = resolve_cluster(env(pet));
  EXPECT_EQ(spec.source, "Kubeflow Trainer environment (PET_*)");
  EXPECT_EQ(spec.world_size, 3);
  EXPECT_EQ(spec.rank, 2);
  EXPECT_EQ(spec.rendezvous.to_string(), "job-node-0-0.job:29500");
  EXPECT_FALSE(spec.is_chief());
  EXPECT_EQ(resolve_cluster(env({{"PET_NNODES", "1"},
                                 {"PET_NODE_RANK", "0"},
                                 {"PET_MASTER_ADDR", "h"},
                                 {"PET_MASTER_PORT", "1"}}))
                .is_chief(),
            true);

  auto under_torchrun = pet;
  under_torchrun.insert(
      {{"RANK", "5"}, {"WORLD_SIZE", "6"}, {"MASTER_ADDR", "h"}, {"MASTER_PORT", "2"}});
  EXPECT_EQ(resolve_cluster(env(under_torchrun)).source, "torchrun environment");
  EXPECT_EQ(resolve_cluster(env(under_torchrun)).rank, 5);

  auto with = [&](const std::string& name, const std::string& value) {
    auto e = pet;
    e[name] = value;
    return error_of(env(e));
  };
  EXPECT_EQ(with("PET_NPROC_PER_NODE", "auto"),
            "PET_NPROC_PER_NODE is \"auto\": the TrainJob expects that many processes on each "
            "node, but flotilla started directly is one; set numProcPerNode: 1 (one flotilla "
            "worker uses all of a node's cores), or start it through torchrun (torchrun "
            "--no-python flotilla train ...)");
  EXPECT_EQ(with("PET_NODE_RANK", "3"),
            "PET_NODE_RANK 3 is out of range for PET_NNODES 3; use 0 to 2");
  EXPECT_NE(with("PET_MASTER_PORT", "")
                .find("PET_MASTER_PORT is not set; Kubeflow Trainer v2 "
                      "sets"),
            std::string::npos);
}

TEST(Resolvers, TorchrunEnvironment) {
  const auto spec = resolve_cluster(env(
      {{"RANK", "2"}, {"WORLD_SIZE", "4"}, {"MASTER_ADDR", "10.1.2.3"}, {"MASTER_PORT", "29500"}}));
  EXPECT_EQ(spec.source, "torchrun environment");
  EXPECT_EQ(spec.rank, 2);
  EXPECT_EQ(spec.world_size, 4);
  EXPECT_FALSE(spec.is_chief());
  EXPECT_EQ(spec.rendezvous.to_string(), "10.1.2.3:29500");
  EXPECT_EQ(spec.local_host, ""); // resolved from this host's name by the transport
  const auto chief = resolve_cluster(env(
      {{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", "1"}}));
  EXPECT_TRUE(chief.is_chief());
  EXPECT_EQ(chief.local_host, "127.0.0.1");
  EXPECT_EQ(chief.task.type, TaskType::kChief);
  EXPECT_EQ(chief.agent_store_key, ""); // MASTER_PORT is free for flotilla's rendezvous
}

// torchrun's agent keeps its c10d store on MASTER_PORT (TORCHELASTIC_USE_AGENT_STORE=True): the
// chief must host elsewhere and publish where, under a key of this run and restart.
TEST(Resolvers, TorchrunWithTheAgentsStoreOnMasterPort) {
  const auto spec = resolve_cluster(env({{"RANK", "1"},
                                         {"WORLD_SIZE", "2"},
                                         {"MASTER_ADDR", "127.0.0.1"},
                                         {"MASTER_PORT", "29500"},
                                         {"TORCHELASTIC_USE_AGENT_STORE", "True"},
                                         {"TORCHELASTIC_RUN_ID", "job-7"},
                                         {"TORCHELASTIC_RESTART_COUNT", "2"}}));
  EXPECT_EQ(spec.rendezvous.to_string(), "127.0.0.1:29500");
  EXPECT_EQ(spec.agent_store_key, "flotilla/rendezvous/job-7/restart-2");
  const auto own_store = resolve_cluster(env({{"RANK", "1"},
                                              {"WORLD_SIZE", "2"},
                                              {"MASTER_ADDR", "127.0.0.1"},
                                              {"MASTER_PORT", "29500"},
                                              {"TORCHELASTIC_USE_AGENT_STORE", "False"}}));
  EXPECT_EQ(own_store.agent_store_key, "");
}

TEST(Resolvers, TorchrunIpv6Master) {
  const auto spec = resolve_cluster(
      env({{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "::1"}, {"MASTER_PORT", "29500"}}));
  EXPECT_EQ(spec.rendezvous.host, "::1");
  EXPECT_EQ(spec.local_host, "::1");
}

TEST(Resolvers, TorchrunErrors) {
  EXPECT_EQ(error_of(env({{"RANK", "0"}, {"MASTER_ADDR", "a"}, {"MASTER_PORT", "1"}})),
            "WORLD_SIZE is not set; torchrun-style launch sets RANK, WORLD_SIZE, MASTER_ADDR and "
            "MASTER_PORT");
  EXPECT_EQ(error_of(env(
                {{"RANK", "x"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "a"}, {"MASTER_PORT", "1"}})),
            "RANK must be an integer >= 0; saw \"x\"; torchrun-style launch sets RANK, "
            "WORLD_SIZE, MASTER_ADDR and MASTER_PORT");
  EXPECT_EQ(error_of(env(
                {{"RANK", "2"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "a"}, {"MASTER_PORT", "1"}})),
            "RANK 2 is out of range for WORLD_SIZE 2; use 0 to 1");
  EXPECT_EQ(error_of(env(
                {{"RANK", "0"}, {"WORLD_SIZE", "0"}, {"MASTER_ADDR", "a"}, {"MASTER_PORT", "1"}})),
            "WORLD_SIZE must be an integer >= 1; saw \"0\"; torchrun-style launch sets RANK, "
            "WORLD_SIZE, MASTER_ADDR and MASTER_PORT");
  EXPECT_EQ(error_of(env({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "1"}})),
            "MASTER_ADDR is not set; torchrun-style launch sets RANK, WORLD_SIZE, MASTER_ADDR and "
            "MASTER_PORT");
  EXPECT_EQ(
      error_of(env(
          {{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "a"}, {"MASTER_PORT", "99999"}})),
      "MASTER_ADDR/MASTER_PORT: port \"99999\" in \"a:99999\" is not a valid port; use a "
      "number from 1 to 65535");
}

TEST(Resolvers, LocalWorldSize) {
  EXPECT_EQ(local_world_size(env({})), 1);
  EXPECT_EQ(local_world_size(env({{"LOCAL_WORLD_SIZE", "4"}})), 4);
  EXPECT_THROW(local_world_size(env({{"LOCAL_WORLD_SIZE", "-1"}})), ConfigError);
}

// Workers started by hand from one TF_CONFIG: those at the same address share its host (loopback
// by any name is one host), so they divide its cores; LOCAL_WORLD_SIZE, where set, wins.
TEST(Resolvers, LocalWorkersFromTfConfigAddresses) {
  const auto tf_config = [](const std::string& type, int index) {
    return R"({"cluster": {"chief": ["127.0.0.1:2222"], "worker": ["localhost:2223", )"
           R"("198.18.0.5:2224", "127.0.0.2:2225"]}, "task": {"type": ")" +
           type + R"(", "index": )" + std::to_string(index) + "}}";
  };
  const LocalWorkers chief = local_workers(env({{"TF_CONFIG", tf_config("chief", 0)}}));
  EXPECT_EQ(chief.count, 3);
  EXPECT_EQ(chief.source, "TF_CONFIG's tasks at this task's address");
  EXPECT_EQ(local_rank(env({{"TF_CONFIG", tf_config("chief", 0)}})), 0);
  EXPECT_EQ(local_rank(env({{"TF_CONFIG", tf_config("worker", 0)}})), 1);
  EXPECT_EQ(local_rank(env({{"TF_CONFIG", tf_config("worker", 2)}})), 2);
  EXPECT_EQ(local_world_size(env({{"TF_CONFIG", tf_config("worker", 1)}})), 1);
  EXPECT_EQ(local_rank(env({{"TF_CONFIG", tf_config("worker", 1)}})), 0);
  const auto launched = env({{"TF_CONFIG", tf_config("worker", 0)}, {"LOCAL_WORLD_SIZE", "2"},
                             {"LOCAL_RANK", "1"}});
  EXPECT_EQ(local_workers(launched).count, 2);
  EXPECT_EQ(local_workers(launched).source, "LOCAL_WORLD_SIZE");
  EXPECT_EQ(local_rank(launched), 1);
  EXPECT_EQ(local_workers(env({})).count, 1);
}

// ---- Slurm -------------------------------------------------------------------------------------

std::vector<std::string> hosts(const std::string& text) {
  return expand_slurm_hostlist(text, "SLURM_STEP_NODELIST");
}

std::string hostlist_error(const std::string& text) {
  try {
    expand_slurm_hostlist(text, "SLURM_STEP_NODELIST");
  } catch (const ConfigError& error) {
    return error.what();
  }
  return "no error";
}

using Hosts = std::vector<std::string>;

TEST(SlurmHostlist, Expands) {
  EXPECT_EQ(hosts("node1"), (Hosts{"node1"}));
  EXPECT_EQ(hosts("a,b,c"), (Hosts{"a", "b", "c"}));
  EXPECT_EQ(hosts("node[1-3]"), (Hosts{"node1", "node2", "node3"}));
  EXPECT_EQ(hosts("node[01-03,07]"), (Hosts{"node01", "node02", "node03", "node07"}));
  EXPECT_EQ(hosts("node[01-03,07],gpu-a[1-2]"),
            (Hosts{"node01", "node02", "node03", "node07", "gpu-a1", "gpu-a2"}));
  EXPECT_EQ(hosts("n[8-11]"), (Hosts{"n8", "n9", "n10", "n11"})); // no padding asked
  EXPECT_EQ(hosts("n[098-101]"), (Hosts{"n098", "n099", "n100", "n101"}));
  EXPECT_EQ(hosts("n[7]"), (Hosts{"n7"}));
  EXPECT_EQ(hosts("n[0009-0010]"), (Hosts{"n0009", "n0010"}));
  EXPECT_EQ(hosts("rack[1-2]-n[1-2]"), (Hosts{"rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"}));
  EXPECT_EQ(hosts("[1-2]x"), (Hosts{"1x", "2x"}));
  EXPECT_EQ(hosts("cn.example.org,n_2[3-4].ib"), (Hosts{"cn.example.org", "n_23.ib", "n_24.ib"}));
  EXPECT_EQ(hosts("a[1,1]"), (Hosts{"a1", "a1"})); // kept as written: Slurm never repeats one
  EXPECT_EQ(hosts("n[0-65535]").size(), 65536u);   // exactly the cap
}

TEST(SlurmHostlist, Errors) {
  const std::string form = "; Slurm writes node lists like \"node[01-03,07],gpu-a[1-2]\"";
  EXPECT_EQ(hostlist_error(""), "SLURM_STEP_NODELIST is empty" + form);
  EXPECT_EQ(hostlist_error("node[1-3"),
            "SLURM_STEP_NODELIST is \"node[1-3\": a '[' is never closed" + form);
  EXPECT_EQ(hostlist_error("node1-3]"),
            "SLURM_STEP_NODELIST is \"node1-3]\": a ']' has no '[' before it" + form);
  EXPECT_EQ(hostlist_error("n[3-1]"),
            "SLURM_STEP_NODELIST is \"n[3-1]\": the range \"3-1\" runs backwards; write it "
            "low-high" +
                form);
  EXPECT_EQ(hostlist_error("n[a-b]"),
            "SLURM_STEP_NODELIST is \"n[a-b]\": \"[a-b]\" holds \"a\", which is not a node "
            "number of 1 to 9 digits" +
                form);
  EXPECT_EQ(hostlist_error("n[]"), "SLURM_STEP_NODELIST is \"n[]\": \"[]\" holds \"\", which is "
                                   "not a node number of 1 to 9 digits" +
                                       form);
  EXPECT_EQ(hostlist_error("a,,b"), "SLURM_STEP_NODELIST is \"a,,b\": it has an empty host name "
                                    "(two commas, or one at an end)" +
                                        form);
  EXPECT_EQ(hostlist_error("a[1[2]]"),
            "SLURM_STEP_NODELIST is \"a[1[2]]\": brackets cannot nest" + form);
  EXPECT_EQ(hostlist_error("a b"), "SLURM_STEP_NODELIST is \"a b\": the character ' ' cannot be "
                                   "part of a host name (letters, digits, '-', '.' and '_')" +
                                       form);
  EXPECT_EQ(hostlist_error("n[0-99999999]"),
            "SLURM_STEP_NODELIST is \"n[0-99999999]\": it names more than 65536 hosts "
            "(\"[0-99999999]\"), more than any job has; the value is damaged" +
                form);
  // Each group is small; their product and the list's sum are what the cap bounds.
  EXPECT_NE(hostlist_error("a[0-999]b[0-999]").find("more than 65536 hosts"), std::string::npos);
  EXPECT_NE(hostlist_error("a[0-40000],b[0-40000]").find("more than 65536 hosts"),
            std::string::npos);
  EXPECT_NE(hostlist_error("n[1-1234567890]").find("not a node number"), std::string::npos);
}

TEST(SlurmTasksPerNode, ExpandsAndRefuses) {
  const auto tasks = [](const std::string& text) {
    return expand_slurm_tasks_per_node(text, "SLURM_STEP_TASKS_PER_NODE");
  };
  EXPECT_EQ(tasks("4"), (std::vector<int>{4}));
  EXPECT_EQ(tasks("2(x3),1"), (std::vector<int>{2, 2, 2, 1}));
  EXPECT_EQ(tasks("1,3(x2)"), (std::vector<int>{1, 3, 3}));
  EXPECT_THROW(tasks(""), ConfigError);
  EXPECT_THROW(tasks("2(x3"), ConfigError);
  EXPECT_THROW(tasks("(x3)"), ConfigError);
  EXPECT_THROW(tasks("0"), ConfigError);
  EXPECT_THROW(tasks("2,,1"), ConfigError);
  try {
    tasks("1(x99999999)");
    FAIL() << "no error";
  } catch (const ConfigError& e) {
    EXPECT_EQ(std::string(e.what()),
              "SLURM_STEP_TASKS_PER_NODE is \"1(x99999999)\": it describes more than 65536 nodes, "
              "more than any job has; the value is damaged; Slurm writes tasks per node like "
              "\"2(x3),1\" (2 tasks on each of 3 nodes, then 1)");
  }
}

std::map<std::string, std::string> slurm_task(int rank, const std::string& node) {
  return {{"SLURM_PROCID", std::to_string(rank)},
          {"SLURM_NTASKS", "6"},
          {"SLURMD_NODENAME", node},
          {"SLURM_STEP_NODELIST", "node[07-09]"},
          {"SLURM_STEP_TASKS_PER_NODE", "2(x3)"},
          {"SLURM_JOB_ID", "1234567"}};
}

TEST(Resolvers, SlurmEnvironment) {
  const auto chief = resolve_cluster(env(slurm_task(0, "node07")));
  EXPECT_EQ(chief.source, "Slurm environment");
  EXPECT_EQ(chief.world_size, 6);
  EXPECT_EQ(chief.rank, 0);
  EXPECT_TRUE(chief.is_chief());
  EXPECT_EQ(chief.task.type, TaskType::kChief);
  // 29500 + 1234567 % 1000
  EXPECT_EQ(chief.rendezvous.to_string(), "node07:30067");
  EXPECT_EQ(chief.local_host, "node07");

  const auto worker = resolve_cluster(env(slurm_task(5, "node09")));
  EXPECT_EQ(worker.rank, 5);
  EXPECT_EQ(worker.task.type, TaskType::kWorker);
  EXPECT_EQ(worker.task.index, 5);
  EXPECT_EQ(worker.rendezvous.to_string(), "node07:30067");
  EXPECT_EQ(worker.local_host, "node09");
}

TEST(Resolvers, SlurmPortAndListFallbacks) {
  auto vars = slurm_task(1, "node08");
  vars["MASTER_PORT"] = "40000";
  EXPECT_EQ(from_slurm_env(env(vars)).rendezvous.to_string(), "node07:40000");
  vars["MASTER_ADDR"] = "10.0.0.7";
  EXPECT_EQ(from_slurm_env(env(vars)).rendezvous.to_string(), "10.0.0.7:40000");

  vars = slurm_task(1, "node08");
  vars.erase("SLURM_JOB_ID");
  vars.erase("SLURM_STEP_NODELIST");
  vars["SLURM_JOB_NODELIST"] = "node[07-08],node09";
  const auto spec = from_slurm_env(env(vars));
  EXPECT_EQ(spec.rendezvous.to_string(), "node07:29500");
  vars["SLURM_JOB_ID"] = "42";
  EXPECT_EQ(from_slurm_env(env(vars)).rendezvous.port, 29542);
}

TEST(Resolvers, SlurmComesAfterTorchrun) {
  auto vars = slurm_task(1, "node08");
  vars.insert({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "a"}, {"MASTER_PORT", "1"}});
  EXPECT_EQ(resolve_cluster(env(vars)).source, "torchrun environment");
  vars = slurm_task(1, "node08");
  vars.erase("SLURM_NTASKS"); // SLURM_PROCID alone is not a Slurm step
  EXPECT_EQ(resolve_cluster(env(vars)).source, "single worker");
}

TEST(Resolvers, SlurmErrors) {
  const std::string fix = "srun sets SLURM_PROCID, SLURM_NTASKS, SLURMD_NODENAME and "
                          "SLURM_STEP_NODELIST for every task: start flotilla with srun "
                          "(docs/deploy.md), or unset SLURM_PROCID to train alone";
  auto with = [](int rank, const std::string& node, const std::string& name,
                 const std::string& value) {
    auto vars = slurm_task(rank, node);
    if (value.empty()) {
      vars.erase(name);
    } else {
      vars[name] = value;
    }
    return env(vars);
  };
  EXPECT_EQ(error_of(with(6, "node07", "SLURM_PROCID", "6")),
            "SLURM_PROCID 6 is out of range for SLURM_NTASKS 6; use 0 to 5 (" + fix + ")");
  EXPECT_EQ(error_of(with(0, "node07", "SLURM_NTASKS", "six")),
            "SLURM_NTASKS must be an integer >= 1; saw \"six\"; " + fix);
  EXPECT_EQ(error_of(with(0, "node07", "SLURMD_NODENAME", "")),
            "SLURMD_NODENAME is not set; " + fix);
  EXPECT_EQ(error_of(with(1, "node07", "SLURMD_NODENAME", "node10")),
            "SLURMD_NODENAME \"node10\" is not among the 3 hosts of SLURM_STEP_NODELIST "
            "\"node[07-09]\"; the variables come from different jobs or steps. " +
                fix);
  EXPECT_EQ(error_of(with(0, "node08", "SLURMD_NODENAME", "node08")),
            "SLURM_PROCID 0 (the chief) runs on \"node08\", not on the first host of "
            "SLURM_STEP_NODELIST (\"node07\"), where the others look for it; use srun's block or "
            "cyclic distribution, or set MASTER_ADDR to the chief's host");
  EXPECT_EQ(error_of(with(1, "node08", "SLURM_STEP_NODELIST", "")),
            "neither SLURM_STEP_NODELIST nor SLURM_JOB_NODELIST is set, so the chief's host is "
            "unknown; " +
                fix);
  EXPECT_EQ(error_of(with(1, "node08", "SLURM_JOB_ID", "12x")),
            "SLURM_JOB_ID must be a job number; saw \"12x\"; Slurm sets it, or set MASTER_PORT "
            "to choose the rendezvous port");
  EXPECT_EQ(error_of(with(1, "node08", "SLURM_STEP_NODELIST", "node[07-09")),
            "SLURM_STEP_NODELIST is \"node[07-09\": a '[' is never closed; Slurm writes node "
            "lists like \"node[01-03,07],gpu-a[1-2]\"");
  EXPECT_EQ(error_of(with(1, "node08", "MASTER_PORT", "0")),
            "MASTER_ADDR/MASTER_PORT: port \"0\" in \"node07:0\" is not a valid port; use a number "
            "from 1 to 65535");
}

TEST(Resolvers, SlurmLocalWorldSize) {
  auto vars = slurm_task(3, "node08");
  vars["SLURM_STEP_TASKS_PER_NODE"] = "3,2,1";
  EXPECT_EQ(local_world_size(env(vars)), 2);
  vars["SLURMD_NODENAME"] = "node09";
  vars["SLURM_PROCID"] = "5";
  EXPECT_EQ(local_world_size(env(vars)), 1);
  vars["LOCAL_WORLD_SIZE"] = "4"; // an explicit count wins
  EXPECT_EQ(local_world_size(env(vars)), 4);
  vars.erase("LOCAL_WORLD_SIZE");
  vars.erase("SLURM_STEP_TASKS_PER_NODE");
  vars["SLURM_TASKS_PER_NODE"] = "1(x2),4";
  EXPECT_EQ(local_world_size(env(vars)), 4);
  vars.erase("SLURM_TASKS_PER_NODE");
  vars["SLURM_NTASKS_PER_NODE"] = "2";
  EXPECT_EQ(local_world_size(env(vars)), 2);
  vars.erase("SLURM_NTASKS_PER_NODE");
  EXPECT_EQ(local_world_size(env(vars)), 2); // 6 tasks over 3 nodes
  vars["SLURM_STEP_TASKS_PER_NODE"] = "2(x2)";
  EXPECT_THROW(local_world_size(env(vars)), ConfigError); // 2 counts for 3 nodes
  vars["TF_CONFIG"] = R"({"cluster": {"worker": ["a:1"]}, "task": {"type": "worker"}})";
  EXPECT_EQ(local_world_size(env(vars)), 1); // not a Slurm cluster then
}

} // namespace
} // namespace flotilla::cluster
