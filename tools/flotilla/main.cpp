// flotilla: synchronous data-parallel training for LibTorch, the tf.distribute way.
#include <c10/util/Exception.h>
#include <sched.h>

#include <iostream>

#include "flotilla/base/system.h"
#include "flotilla/error.h"
#include "flotilla/log.h"
#include "tools/flotilla/commands.h"
#include "tools/flotilla/flags.h"

int main(int argc, char** argv) {
  using namespace flotilla;
  base::raise_open_file_limit(); // connections are descriptors (base/system.h)
  // The library's messages name API fields; a CLI user is told the flag beside each.
  set_log_rewrite(tools::with_flags);
  CLI::App app{"flotilla: synchronous data-parallel training for LibTorch models, configured by "
               "TF_CONFIG like TensorFlow's MultiWorkerMirroredStrategy"};
  app.name("flotilla");
  app.require_subcommand(1);
  app.set_version_flag("--version", std::string("flotilla ") + FLOTILLA_VERSION);
  std::vector<tools::Command> commands = {tools::add_train(app), tools::add_launch(app),
                                          tools::add_tf_config(app), tools::add_plan(app)};
  commands.push_back(tools::add_tune(app));
  commands.push_back(tools::add_doctor(app));
  commands.push_back(tools::add_rendezvous(app));
  try {
    app.parse(argc, argv);
  } catch (const CLI::Success& e) {
    return app.exit(e); // --help, --version
  } catch (const CLI::ParseError& e) {
    std::string where = "flotilla";
    for (const auto* sub : app.get_subcommands()) where += " " + sub->get_name();
    // CLI11's messages echo the value given: escaped and cut as every error line is.
    std::cerr << where << ": error: " << printable(e.what(), 1000) << " (see " << where
              << " --help)\n";
    return kExitBadInput;
  }
  for (const auto& command : commands) {
    if (!command.app->parsed()) continue;
    try {
      return command.run();
    } catch (const Preempted& e) { // not an error: the job is to be started again
      std::cerr << "flotilla " << command.app->get_name() << ": "
                << printable(tools::with_flags(e.what())) << "\n";
      return kExitPreempted;
    } catch (const c10::Error& e) { // LibTorch's own: its message, not its backtrace
      std::cerr << "flotilla " << command.app->get_name()
                << ": error: " << printable(e.what_without_backtrace()) << "\n";
      return kExitFailure;
    } catch (const std::exception& e) {
      std::cerr << "flotilla " << command.app->get_name()
                << ": error: " << printable(tools::with_flags(e.what())) << "\n";
      return exit_code(e);
    }
  }
  return kExitBadInput;
}
