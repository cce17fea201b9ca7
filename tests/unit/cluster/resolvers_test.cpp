#include <gtest/gtest.h>

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

} // namespace
} // namespace flotilla::cluster
