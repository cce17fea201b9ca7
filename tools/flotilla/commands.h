// The flotilla CLI's subcommands. Each registers its flags on the parent app and returns the
// function main() runs when it was chosen; that function returns the exit code and lets
// flotilla::Error escape for main() to print as one line.
#pragma once

#include <CLI/CLI.hpp>

#include <functional>

namespace flotilla::tools {

struct Command {
  CLI::App* app;
  std::function<int()> run;
};

Command add_train(CLI::App& parent);
Command add_launch(CLI::App& parent);
Command add_tf_config(CLI::App& parent);
Command add_plan(CLI::App& parent);
Command add_tune(CLI::App& parent);
Command add_doctor(CLI::App& parent);
Command add_rendezvous(CLI::App& parent);

} // namespace flotilla::tools
