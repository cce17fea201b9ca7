#include <gtest/gtest.h>

#include "flotilla/cluster/cluster_spec.h"
#include "flotilla/error.h"

namespace flotilla::cluster {
namespace {

TEST(TfConfig, WorkersOnlyMakeWorkerZeroTheChief) {
  const auto spec = parse_tf_config(
      R"({"cluster": {"worker": ["host1:2222", "host2:2222", "host3:2222"]},
          "task": {"type": "worker", "index": 2}})");
  EXPECT_EQ(spec.world_size, 3);
  EXPECT_EQ(spec.rank, 2);
  EXPECT_FALSE(spec.is_chief());
  EXPECT_EQ(spec.rendezvous.to_string(), "host1:2222");
  EXPECT_EQ(spec.local_host, "host3");
  EXPECT_EQ(spec.source, "TF_CONFIG");
  EXPECT_TRUE(parse_tf_config(R"({"cluster": {"worker": ["a:1", "b:2"]},
                                  "task": {"type": "worker", "index": 0}})")
                  .is_chief());
}

TEST(TfConfig, ChiefComesFirstThenWorkersByIndex) {
  const std::string cluster =
      R"("cluster": {"chief": ["c:1000"], "worker": ["w0:1001", "w1:1002"]})";
  const auto chief = parse_tf_config("{" + cluster + R"(, "task": {"type": "chief"}})");
  EXPECT_EQ(chief.rank, 0);
  EXPECT_TRUE(chief.is_chief());
  EXPECT_EQ(chief.world_size, 3);
  const auto w1 = parse_tf_config("{" + cluster + R"(, "task": {"type": "worker", "index": 1}})");
  EXPECT_EQ(w1.rank, 2);
  EXPECT_EQ(w1.rendezvous.to_string(), "c:1000");
  const auto order = w1.training_addresses();
  ASSERT_EQ(order.size(), 3u);
  EXPECT_EQ(order[0].to_string(), "c:1000");
  EXPECT_EQ(order[1].to_string(), "w0:1001");
  EXPECT_EQ(order[2].to_string(), "w1:1002");
}

TEST(TfConfig, EvaluatorIsOutsideTheTrainingGroup) {
  const auto spec = parse_tf_config(
      R"({"cluster": {"worker": ["a:1", "b:2"], "evaluator": ["e:3"]},
          "task": {"type": "evaluator", "index": 0}})");
  EXPECT_TRUE(spec.is_evaluator());
  EXPECT_EQ(spec.rank, -1);
  EXPECT_EQ(spec.world_size, 2);
  EXPECT_FALSE(spec.is_chief());
}

TEST(TfConfig, AcceptsRpcLayerEnvironmentAndEmptyPs) {
  const auto spec = parse_tf_config(
      R"({"cluster": {"worker": ["a:1"], "ps": []}, "task": {"type": "worker", "index": 0},
          "rpc_layer": "grpc", "environment": "cloud"})");
  EXPECT_EQ(spec.rpc_layer, "grpc");
  EXPECT_EQ(spec.environment, "cloud");
  EXPECT_EQ(spec.world_size, 1);
}

TEST(TfConfig, IndexDefaultsToZeroAsInTensorFlow) {
  const auto spec = parse_tf_config(R"({"cluster": {"worker": ["a:1", "b:2"]},
                                        "task": {"type": "worker"}})");
  EXPECT_EQ(spec.task.index, 0);
  EXPECT_EQ(spec.rank, 0);
}

TEST(TfConfig, Ipv6Addresses) {
  const auto spec = parse_tf_config(R"({"cluster": {"worker": ["[::1]:2222", "[fe80::2]:2223"]},
                                        "task": {"type": "worker", "index": 1}})");
  EXPECT_EQ(spec.local_host, "fe80::2");
  EXPECT_EQ(spec.rendezvous.host, "::1");
  EXPECT_EQ(spec.rendezvous.port, 2222);
  EXPECT_EQ(spec.rendezvous.to_string(), "[::1]:2222");
}

TEST(TfConfig, RoundTripsThroughToTfConfig) {
  const auto spec = parse_tf_config(
      R"({"cluster": {"chief": ["c:1"], "worker": ["a:2", "b:3"], "evaluator": ["e:4"]},
          "task": {"type": "worker", "index": 1}, "rpc_layer": "grpc"})");
  const auto again = parse_tf_config(to_tf_config(spec));
  EXPECT_EQ(again.chief, spec.chief);
  EXPECT_EQ(again.worker, spec.worker);
  EXPECT_EQ(again.evaluator, spec.evaluator);
  EXPECT_EQ(again.rank, 2);
  EXPECT_EQ(again.rpc_layer, "grpc");
}

struct BadCase {
  const char* name;
  const char* json;
  const char* message;
};

void PrintTo(const BadCase& c, std::ostream* os) {
  *os << c.json;
}

class TfConfigErrors : public ::testing::TestWithParam<BadCase> {};

TEST_P(TfConfigErrors, SayWhatWasWrongTheValueAndTheFix) {
  const BadCase& c = GetParam();
  try {
    parse_tf_config(c.json);
    FAIL() << "accepted: " << c.json;
  } catch (const ConfigError& e) {
    EXPECT_EQ(std::string(e.what()), c.message);
  }
}

const BadCase kBadCases[] = {
    {"InvalidJson", R"({"cluster": {"worker": ["a:1"]},)",
     "TF_CONFIG is not valid JSON (parse error at line 1, column 33: syntax error while parsing "
     "object key - unexpected end of input; expected string literal); e.g. {\"cluster\": "
     "{\"worker\": [\"host1:2222\", \"host2:2222\"]}, \"task\": {\"type\": \"worker\", \"index\": "
     "0}}"},
    // Found by tests/fuzz: nlohmann reports this as out_of_range, not parse_error, and it escaped.
    {"NumberOverflow", R"({"cluster": {"worker": ["a:1"]}, "task": {"index": 1e999}})",
     "TF_CONFIG is not valid JSON (number overflow parsing '1e999'); e.g. {\"cluster\": "
     "{\"worker\": [\"host1:2222\", \"host2:2222\"]}, \"task\": {\"type\": \"worker\", \"index\": "
     "0}}"},
    {"NotAnObject", R"(["a:1"])",
     "TF_CONFIG must be a JSON object; saw array [\"a:1\"]; e.g. {\"cluster\": {\"worker\": "
     "[\"host1:2222\", \"host2:2222\"]}, \"task\": {\"type\": \"worker\", \"index\": 0}}"},
    {"MissingTask", R"({"cluster": {"worker": ["a:1"]}})",
     "TF_CONFIG has no \"task\"; add \"task\": {\"type\": \"worker\", \"index\": i} to say which "
     "task this process is"},
    {"UnknownTaskType", R"({"cluster": {"worker": ["a:1"]}, "task": {"type": "boss"}})",
     "TF_CONFIG task.type \"boss\" is not a task type; use \"chief\", \"worker\" or "
     "\"evaluator\""},
    {"IndexOutOfRange",
     R"({"cluster": {"worker": ["a:1", "b:2", "c:3"]}, "task": {"type": "worker", "index": 3}})",
     "TF_CONFIG task.index 3 is out of range: cluster.worker has 3 addresses, so use 0 to 2"},
    {"NegativeIndex",
     R"({"cluster": {"worker": ["a:1", "b:2"]}, "task": {"type": "worker", "index": -1}})",
     "TF_CONFIG task.index is -1; an index counts from 0: use 0 to 1 for the 2 \"worker\" "
     "addresses"},
    {"IndexNotInteger",
     R"({"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": "one"}})",
     "TF_CONFIG task.index must be an integer (or a string of one, as TF's int() takes); saw the "
     "string \"one\""},
    {"IndexFloat",
     R"({"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": 0.5}})",
     "TF_CONFIG task.index must be an integer (or a string of one, as TF's int() takes); saw the "
     "number 0.5"},
    {"DuplicateAddress",
     R"({"cluster": {"chief": ["a:1"], "worker": ["b:2", "a:1"]}, "task": {"type": "chief"}})",
     "TF_CONFIG address \"a:1\" appears twice (cluster.chief[0] and cluster.worker[1]); every "
     "task needs its own host:port"},
    {"NoPort", R"({"cluster": {"worker": ["a:1", "host2"]}, "task": {"type": "worker"}})",
     "TF_CONFIG cluster.worker[1]: \"host2\" has no port; write \"host:port\", e.g. "
     "\"10.0.0.2:2222\""},
    {"PortZero", R"({"cluster": {"worker": ["a:0"]}, "task": {"type": "worker"}})",
     "TF_CONFIG cluster.worker[0]: port \"0\" in \"a:0\" is not a valid port; use a number from 1 "
     "to 65535"},
    {"PortTooLarge", R"({"cluster": {"worker": ["a:65536"]}, "task": {"type": "worker"}})",
     "TF_CONFIG cluster.worker[0]: port \"65536\" in \"a:65536\" is not a valid port; use a number "
     "from 1 to 65535"},
    {"PortNotNumeric", R"({"cluster": {"worker": ["a:http"]}, "task": {"type": "worker"}})",
     "TF_CONFIG cluster.worker[0]: port \"http\" in \"a:http\" is not a valid port; use a number "
     "from 1 to 65535"},
    {"EmptyHost", R"({"cluster": {"worker": [":2222"]}, "task": {"type": "worker"}})",
     "TF_CONFIG cluster.worker[0]: \":2222\" has an empty host; write \"host:port\", e.g. "
     "\"10.0.0.2:2222\""},
    {"TwoChiefs",
     R"({"cluster": {"chief": ["a:1", "b:2"], "worker": ["c:3"]}, "task": {"type": "worker"}})",
     "TF_CONFIG cluster.chief lists 2 addresses (\"a:1\", \"b:2\"); a cluster has at most one "
     "chief: keep one and list the others under \"worker\""},
    {"TwoEvaluators",
     R"({"cluster": {"worker": ["c:3"], "evaluator": ["a:1", "b:2"]}, "task": {"type": "worker"}})",
     "TF_CONFIG cluster.evaluator lists 2 addresses (\"a:1\", \"b:2\"); a cluster has at most one "
     "evaluator: keep one; the others cannot join training"},
    {"OnlyAnEvaluator", R"({"cluster": {"evaluator": ["e:1"]}, "task": {"type": "evaluator"}})",
     "TF_CONFIG cluster is empty: it lists no \"chief\" or \"worker\" address; e.g. {\"cluster\": "
     "{\"worker\": [\"host1:2222\", \"host2:2222\"]}, \"task\": {\"type\": \"worker\", \"index\": "
     "0}}"},
    {"TaskTypeAbsentFromCluster", R"({"cluster": {"worker": ["a:1"]}, "task": {"type": "chief"}})",
     "TF_CONFIG task.type is \"chief\" but cluster has no \"chief\" addresses; add them to "
     "cluster or use a type it lists (\"worker\")"},
    {"NonStringAddress", R"({"cluster": {"worker": ["a:1", 2222]}, "task": {"type": "worker"}})",
     "TF_CONFIG cluster.worker[1] must be a \"host:port\" string; saw the number 2222"},
    {"JobNotAList", R"({"cluster": {"worker": "a:1"}, "task": {"type": "worker"}})",
     "TF_CONFIG cluster.worker must be a list of \"host:port\" strings; saw the string \"a:1\""},
    {"ParameterServers",
     R"({"cluster": {"worker": ["a:1"], "ps": ["p:2"]}, "task": {"type": "worker"}})",
     "TF_CONFIG cluster has \"ps\" tasks: parameter-server training is not supported; use "
     "chief/worker"},
    {"PsTask", R"({"cluster": {"worker": ["a:1"]}, "task": {"type": "ps", "index": 0}})",
     "TF_CONFIG task.type is \"ps\": parameter-server training is not supported; use "
     "chief/worker"},
    {"UnknownJob",
     R"({"cluster": {"worker": ["a:1"], "trainer": ["b:2"]}, "task": {"type": "worker"}})",
     "TF_CONFIG cluster has unknown task type \"trainer\"; use \"chief\", \"worker\" and "
     "\"evaluator\""},
    {"ChiefAndMaster",
     R"({"cluster": {"chief": ["a:1"], "master": ["b:2"]}, "task": {"type": "chief"}})",
     "TF_CONFIG cluster lists both \"chief\" and \"master\" (the chief's deprecated name); keep "
     "one"},
    {"MissingTaskType", R"({"cluster": {"worker": ["a:1"]}, "task": {"index": 0}})",
     "TF_CONFIG task has no \"type\"; set it to \"chief\", \"worker\" or \"evaluator\""},
    {"TaskNotObject", R"({"cluster": {"worker": ["a:1"]}, "task": "worker"})",
     "TF_CONFIG task must be an object like {\"type\": \"worker\", \"index\": 0}; saw the string "
     "\"worker\""},
    {"Ipv6WithoutBrackets", R"({"cluster": {"worker": ["::1:2222"]}, "task": {"type": "worker"}})",
     "TF_CONFIG cluster.worker[0]: \"::1:2222\" looks like an IPv6 address without brackets; "
     "write \"[::1]:2222\""},
    {"RpcLayerNotString",
     R"({"cluster": {"worker": ["a:1"]}, "task": {"type": "worker"}, "rpc_layer": 1})",
     "TF_CONFIG rpc_layer must be a string; saw the number 1"},
};

INSTANTIATE_TEST_SUITE_P(Table, TfConfigErrors, ::testing::ValuesIn(kBadCases),
                         [](const auto& info) { return std::string(info.param.name); });

// TF_CONFIGs as launchers write them (shapes from their documentation), which TF accepts.
TEST(TfConfigFromLaunchers, KubeflowTfJobWithChiefWorkersEvaluatorAndDnsNames) {
  const char* kTfJob =
      R"({"cluster":{"chief":["mnist-chief-0.kubeflow.svc:2222"],)"
      R"("evaluator":["mnist-evaluator-0.kubeflow.svc:2222"],)"
      R"("worker":["mnist-worker-0.kubeflow.svc:2222","mnist-worker-1.kubeflow.svc:2222"]},)"
      R"("task":{"type":"worker","index":1},"environment":"cloud"})";
  const auto spec = parse_tf_config(kTfJob);
  EXPECT_EQ(spec.world_size, 3);
  EXPECT_EQ(spec.rank, 2);
  EXPECT_EQ(spec.rendezvous.to_string(), "mnist-chief-0.kubeflow.svc:2222");
  EXPECT_EQ(spec.local_host, "mnist-worker-1.kubeflow.svc");
  EXPECT_EQ(spec.environment, "cloud");
  EXPECT_TRUE(spec.notes.empty());
}

TEST(TfConfigFromLaunchers, VertexAiWithItsJobStringAndANumericStringIndex) {
  const char* kVertex =
      R"({"cluster":{"chief":["cmle-training-workerpool0-ab12cd-0:2222"],)"
      R"("worker":["cmle-training-workerpool1-ab12cd-0:2222",)"
      R"("cmle-training-workerpool1-ab12cd-1:2222"]},"environment":"cloud",)"
      R"("task":{"type":"worker","index":"1","trial":"3"},)"
      R"("job":"{\"python_module\":\"\",\"package_uris\":[],\"job_args\":[]}"})";
  const auto spec = parse_tf_config(kVertex);
  EXPECT_EQ(spec.task.index, 1);
  EXPECT_EQ(spec.rank, 2);
  EXPECT_EQ(spec.world_size, 3);
}

TEST(TfConfigFromLaunchers, AiPlatformTrainingMasterIsTheChiefWithANote) {
  const std::string cluster =
      R"("cluster":{"master":["cmle-training-master-5a8f-0:2222"],)"
      R"("worker":["cmle-training-worker-5a8f-0:2222","cmle-training-worker-5a8f-1:2222"]},)"
      R"("environment":"cloud","job":{"scale_tier":"CUSTOM","master_type":"n1-standard-8",)"
      R"("worker_type":"n1-standard-8","worker_count":"2","region":"us-central1"},)";
  const auto master = parse_tf_config(
      "{" + cluster + R"("task":{"type":"master","index":0,"cloud":"a1b2c3","trial":"1"}})");
  EXPECT_TRUE(master.is_chief());
  EXPECT_EQ(master.task.type, TaskType::kChief);
  EXPECT_EQ(master.world_size, 3);
  EXPECT_EQ(master.rendezvous.to_string(), "cmle-training-master-5a8f-0:2222");
  ASSERT_EQ(master.notes.size(), 1u);
  EXPECT_NE(master.notes[0].find("\"master\" is the deprecated name of the chief"),
            std::string::npos);
  const auto worker = parse_tf_config("{" + cluster + R"("task":{"type":"worker","index":1}})");
  EXPECT_EQ(worker.rank, 2);
  // What flotilla writes back names it the chief.
  EXPECT_NE(to_tf_config(master).find("\"chief\""), std::string::npos);
}

TEST(TfConfigFromLaunchers, NoClusterIsThisMachineAlone) {
  for (const char* text : {"{}", R"({"task": {"type": "worker", "index": 0}})",
                           R"({"cluster": {}, "task": {"type": "worker", "index": 0}})",
                           R"({"cluster": {}, "environment": "cloud"})"}) {
    const auto spec = parse_tf_config(text);
    EXPECT_EQ(spec.world_size, 1) << text;
    EXPECT_EQ(spec.rank, 0) << text;
    EXPECT_TRUE(spec.is_chief()) << text;
    EXPECT_EQ(spec.source, "TF_CONFIG without a cluster: this machine alone") << text;
  }
}

TEST(Address, ParsesHostAndPortAndNamesTheFieldInErrors) {
  const Address a = parse_address("10.0.0.2:2222", "X");
  EXPECT_EQ(a.host, "10.0.0.2");
  EXPECT_EQ(a.port, 2222);
  EXPECT_EQ(parse_address("h:65535", "X").port, 65535);
  try {
    parse_address("[::1", "--chief");
    FAIL();
  } catch (const ConfigError& e) {
    EXPECT_EQ(std::string(e.what()),
              "--chief: \"[::1\" opens '[' without ']'; write \"host:port\", e.g. "
              "\"10.0.0.2:2222\"");
  }
}

} // namespace
} // namespace flotilla::cluster
