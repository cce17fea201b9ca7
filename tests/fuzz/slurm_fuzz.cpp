// Slurm's variables: the input's lines are, in order, SLURM_STEP_NODELIST,
// SLURM_STEP_TASKS_PER_NODE, SLURM_PROCID, SLURM_NTASKS, SLURMD_NODENAME, SLURM_JOB_ID and
// MASTER_PORT (missing lines leave the variable unset). The first two lines are also expanded
// on their own, as hostlist and tasks-per-node text.
#include <map>
#include <vector>

#include "flotilla/cluster/resolvers.h"
#include "tests/fuzz/fuzz_support.h"

using namespace flotilla::cluster;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view text = flotilla::fuzz::as_text(data, size);
  std::vector<std::string> lines;
  for (std::size_t start = 0; start <= text.size();) {
    const std::size_t end = std::min(text.find('\n', start), text.size());
    lines.emplace_back(text.substr(start, end - start));
    start = end + 1;
  }
  static const char* const kNames[] = {"SLURM_STEP_NODELIST", "SLURM_STEP_TASKS_PER_NODE",
                                       "SLURM_PROCID",        "SLURM_NTASKS",
                                       "SLURMD_NODENAME",     "SLURM_JOB_ID",
                                       "MASTER_PORT"};
  std::map<std::string, std::string> vars;
  for (std::size_t i = 0; i < lines.size() && i < std::size(kNames); ++i)
    vars[kNames[i]] = lines[i];
  const Environment env(vars);

  flotilla::fuzz::expect_only_flotilla_errors(
      [&] { expand_slurm_hostlist(lines[0], "SLURM_STEP_NODELIST"); });
  if (lines.size() > 1) {
    flotilla::fuzz::expect_only_flotilla_errors(
        [&] { expand_slurm_tasks_per_node(lines[1], "SLURM_STEP_TASKS_PER_NODE"); });
  }
  flotilla::fuzz::expect_only_flotilla_errors([&] { resolve_cluster(env); });
  flotilla::fuzz::expect_only_flotilla_errors([&] { local_world_size(env); });
  return 0;
}
