#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "flotilla/cluster/cluster_token.h"
#include "flotilla/error.h"

namespace flotilla::cluster {
namespace {

namespace fs = std::filesystem;

Environment env(std::map<std::string, std::string> vars) {
  return Environment(std::move(vars));
}

class ClusterToken : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("flotilla-token-" + std::to_string(::getpid()));
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  fs::path write(const std::string& name, const std::string& content, mode_t mode) {
    const fs::path path = dir_ / name;
    std::ofstream(path) << content;
    ::chmod(path.c_str(), mode);
    return path;
  }
  std::string error_of(const Environment& env, const std::optional<fs::path>& file = {}) {
    try {
      cluster_token(env, file);
    } catch (const ConfigError& e) {
      return e.what();
    }
    return "no error";
  }
  fs::path dir_;
};

TEST_F(ClusterToken, NoneSetMeansNoAuthentication) {
  EXPECT_EQ(cluster_token(Environment()), std::nullopt);
}

TEST_F(ClusterToken, FromTheVariableOrAFileWithoutItsNewline) {
  EXPECT_EQ(cluster_token(env({{"FLOTILLA_CLUSTER_TOKEN", "abc"}})), "abc");
  const auto file = write("token", "from-file\n", 0600);
  EXPECT_EQ(cluster_token(env({{"FLOTILLA_CLUSTER_TOKEN_FILE", file.string()}})),
            "from-file");
  // --cluster-token-file wins over FLOTILLA_CLUSTER_TOKEN_FILE.
  const auto flag = write("flag", "from-flag", 0400);
  EXPECT_EQ(cluster_token(env({{"FLOTILLA_CLUSTER_TOKEN_FILE", file.string()}}), flag),
            "from-flag");
}

TEST_F(ClusterToken, AFileOthersCanReadIsRefusedWithTheFix) {
  const auto file = write("open", "secret", 0644);
  const std::string error = error_of(Environment(), file);
  EXPECT_NE(error.find("can be read or written by other users (mode 644); run chmod 600 on it"),
            std::string::npos)
      << error;
  EXPECT_EQ(error.find("secret"), std::string::npos) << "the token must not be in the message";
}

TEST_F(ClusterToken, MissingEmptyOrAmbiguousSourcesAreClearErrors) {
  EXPECT_NE(error_of(env({{"FLOTILLA_CLUSTER_TOKEN_FILE", (dir_ / "nope").string()}}))
                .find("cannot read the cluster token file " + (dir_ / "nope").string() +
                      " (FLOTILLA_CLUSTER_TOKEN_FILE): No such file or directory"),
            std::string::npos);
  const auto empty = write("empty", "\n", 0600);
  EXPECT_NE(error_of(Environment(), empty).find("is empty or unreadable"), std::string::npos);
  const auto file = write("token", "x", 0600);
  EXPECT_NE(error_of(env({{"FLOTILLA_CLUSTER_TOKEN", "y"}}), file)
                .find("both FLOTILLA_CLUSTER_TOKEN and a token file (the file given to "
                      "cluster::cluster_token) are set; keep one of them"),
            std::string::npos);
  EXPECT_NE(error_of(Environment(), dir_).find("is not a regular file"), std::string::npos);
}

// Set but empty is a mistake (a template's ${TOKEN} that expanded to nothing), not "no token":
// before, it silently ran the job unauthenticated.
TEST_F(ClusterToken, AVariableSetButEmptyIsAnErrorNotNoAuthentication) {
  EXPECT_EQ(error_of(env({{"FLOTILLA_CLUSTER_TOKEN", ""}})),
            "FLOTILLA_CLUSTER_TOKEN is set but empty, which would mean no authentication at all; "
            "set a long random secret (e.g. openssl rand -hex 32), or unset it to run without a "
            "token");
  EXPECT_EQ(error_of(env({{"FLOTILLA_CLUSTER_TOKEN_FILE", ""}})),
            "FLOTILLA_CLUSTER_TOKEN_FILE is set but empty, which would mean no authentication at "
            "all; set a long random secret (e.g. openssl rand -hex 32 into a file it names), or "
            "unset it to run without a token");
  // An empty variable beside a token file given explicitly is the same mistake.
  const auto file = write("token", "x", 0600);
  EXPECT_NE(error_of(env({{"FLOTILLA_CLUSTER_TOKEN", ""}}), file).find("set but empty"),
            std::string::npos);
}

} // namespace
} // namespace flotilla::cluster
