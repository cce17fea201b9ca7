// `flotilla tf-config`: prints the TF_CONFIG for one task of a cluster given as flags, checked by
// the same parser workers use. For running by hand on several machines:
//   export TF_CONFIG=$(flotilla tf-config --workers a:2222,b:2222 --index 1)
#include <iostream>

#include "flotilla/cluster/cluster_spec.h"
#include "tools/flotilla/commands.h"

namespace flotilla::tools {
namespace {

struct TfConfigArgs {
  std::vector<std::string> workers;
  std::string chief;
  std::string evaluator;
  std::string type = "worker";
  int index = 0;
};

std::vector<cluster::Address> addresses(const std::vector<std::string>& texts,
                                        const std::string& flag) {
  std::vector<cluster::Address> out;
  for (std::size_t i = 0; i < texts.size(); ++i) {
    out.push_back(cluster::parse_address(texts[i], flag + " entry " + std::to_string(i)));
  }
  return out;
}

int run(const TfConfigArgs& a) {
  cluster::ClusterSpec spec;
  spec.worker = addresses(a.workers, "--workers");
  if (!a.chief.empty()) spec.chief = {cluster::parse_address(a.chief, "--chief")};
  if (!a.evaluator.empty()) spec.evaluator = {cluster::parse_address(a.evaluator, "--evaluator")};
  spec.task.type = a.type == "chief"       ? cluster::TaskType::kChief
                   : a.type == "evaluator" ? cluster::TaskType::kEvaluator
                                           : cluster::TaskType::kWorker;
  spec.task.index = a.index;
  const std::string json = cluster::to_tf_config(spec);
  cluster::parse_tf_config(json); // the same rules a worker applies, before anyone starts
  std::cout << json << "\n";
  return 0;
}

} // namespace

Command add_tf_config(CLI::App& parent) {
  auto args = std::make_shared<TfConfigArgs>();
  CLI::App* app = parent.add_subcommand(
      "tf-config", "Print valid TF_CONFIG JSON for one task of a cluster given as flags");
  app->add_option("--workers", args->workers, "Worker addresses host:port, comma-separated")
      ->delimiter(',');
  app->add_option("--chief", args->chief, "The chief's host:port (else worker 0 is the chief)");
  app->add_option("--evaluator", args->evaluator, "An evaluator's host:port (not in training)");
  app->add_option("--type", args->type, "This task's type")
      ->check(CLI::IsMember({"chief", "worker", "evaluator"}))
      ->capture_default_str();
  app->add_option("--index", args->index, "This task's index within its type")->required();
  app->footer("Example: export TF_CONFIG=$(flotilla tf-config --workers a:2222,b:2222 --index 1)");
  return {app, [args] { return run(*args); }};
}

} // namespace flotilla::tools
