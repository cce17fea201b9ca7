// `flotilla rendezvous`: the rendezvous as a process of its own, outside the workers, so that it
// outlives any of them (torchrun's rendezvous endpoint, torchft's Lighthouse). Every task is
// given FLOTILLA_RENDEZVOUS=HOST:PORT and the same cluster token; in elastic mode (the default)
// it decides who is in the group, generation by generation (see collective/elastic.h). It
// serves until SIGTERM or SIGINT.
#include <atomic>
#include <chrono>
#include <csignal>
#include <ctime>
#include <iomanip>
#include <iostream>
#include <thread>

#include "flotilla/cluster/cluster_token.h"
#include "flotilla/cluster/environment.h"
#include "flotilla/cluster/resolvers.h"
#include "flotilla/collective/elastic.h"
#include "flotilla/error.h"
#include "tools/flotilla/commands.h"
#include "tools/flotilla/flags.h"

namespace flotilla::tools {
namespace {

struct RendezvousArgs {
  std::string listen;
  int workers = 0;
  double heartbeat_timeout_s = 10;
  bool fixed = false;
  bool insecure = false;
  std::string etcd;
  std::string etcd_cacert, etcd_cert, etcd_key, etcd_user;
};

// --etcd: one of several replicas, serving while etcd names it (serve_rendezvous_replica).
int run_replica(const RendezvousArgs& a, const collective::RendezvousService::Options& options,
                const sigset_t& stop) {
  auto etcd = cluster::parse_etcd_rendezvous(a.etcd, "--etcd");
  etcd.ca_file = a.etcd_cacert;
  etcd.cert_file = a.etcd_cert;
  etcd.key_file = a.etcd_key;
  etcd.user = a.etcd_user;
  cluster::complete_etcd_security(etcd, cluster::Environment::from_process());
  std::atomic<int> signal{0};
  std::thread waiter([&] {
    int s = 0;
    sigwait(&stop, &s);
    signal = s;
  });
  // etcd refusing this replica (its certificate, user or rights) ends it with that error; the
  // waiter would wait for a signal nobody sends.
  struct Detach {
    std::thread& t;
    ~Detach() {
      if (t.joinable()) t.detach();
    }
  } detach{waiter};
  std::cout << "flotilla rendezvous: a replica of job \"" << etcd.job << "\" (" << etcd.url()
            << (etcd.tls ? ", TLS" : "") << (etcd.user.empty() ? "" : ", etcd user " + etcd.user)
            << "), for " << (a.fixed ? "a fixed group" : "an elastic group") << " of " << a.workers
            << " workers; set FLOTILLA_RENDEZVOUS=" << a.etcd << " on every task" << std::endl;
  collective::serve_rendezvous_replica(
      options, etcd, [&] { return signal != 0; },
      [](const std::string& what) {
        // With the time of day, to read beside etcd's own log.
        const auto now = std::chrono::system_clock::now();
        const std::time_t t = std::chrono::system_clock::to_time_t(now);
        const auto ms =
            std::chrono::duration_cast<std::chrono::milliseconds>(now.time_since_epoch()).count() %
            1000;
        char stamp[32];
        std::strftime(stamp, sizeof stamp, "%H:%M:%S", std::localtime(&t));
        std::cout << "flotilla rendezvous: " << stamp << "." << std::setfill('0') << std::setw(3)
                  << ms << " " << what << std::endl;
      });
  waiter.join();
  std::cout << "flotilla rendezvous: stopped by " << (signal == SIGINT ? "SIGINT" : "SIGTERM")
            << std::endl;
  return 0;
}

int run(const RendezvousArgs& a) {
  collective::RendezvousService::Options options;
  options.listen = cluster::parse_address(a.listen, "--listen");
  options.workers = a.workers;
  options.elastic = !a.fixed;
  options.heartbeat_timeout = seconds_flag(a.heartbeat_timeout_s, "--heartbeat-timeout");
  options.cluster_token = cluster::cluster_token(cluster::Environment::from_process());
  options.insecure = a.insecure;
  // Blocked before the service's thread starts, so only sigwait below receives them.
  sigset_t stop;
  sigemptyset(&stop);
  sigaddset(&stop, SIGTERM);
  sigaddset(&stop, SIGINT);
  pthread_sigmask(SIG_BLOCK, &stop, nullptr);
  if (!a.etcd.empty()) return run_replica(a, options, stop);
  if (!(a.etcd_cacert + a.etcd_cert + a.etcd_key + a.etcd_user).empty()) {
    throw ConfigError("--etcd-cacert, --etcd-cert, --etcd-key and --etcd-user are for a replica "
                      "elected through etcd; give --etcd etcds://HOST:PORT,.../JOB too");
  }
  collective::RendezvousService service(options);
  std::cout << "flotilla rendezvous: serving " << (a.fixed ? "a fixed group" : "an elastic group")
            << " of " << a.workers << " workers at " << service.address()
            << (options.cluster_token ? " (cluster token required)" : "")
            << "; set FLOTILLA_RENDEZVOUS=" << service.address() << " on every task" << std::endl;
  int signal = 0;
  sigwait(&stop, &signal);
  std::cout << "flotilla rendezvous: stopped by " << (signal == SIGINT ? "SIGINT" : "SIGTERM")
            << std::endl;
  return 0;
}

} // namespace

Command add_rendezvous(CLI::App& parent) {
  auto args = std::make_shared<RendezvousArgs>();
  CLI::App* app = parent.add_subcommand(
      "rendezvous", "Host the rendezvous outside the workers, so it outlives any of them");
  app->add_option("--listen", args->listen, "HOST:PORT to listen on (that address only)")
      ->required();
  app->add_option("--workers", args->workers, "Training tasks in the cluster (chief + workers)")
      ->required()
      ->check(number_in(1, 65536));
  app->add_option("--heartbeat-timeout", args->heartbeat_timeout_s,
                  "Seconds of silence after which a worker is expelled")
      ->check(number_in(0.1, 3600.0)) // below its members' heartbeats, everyone is expelled
      ->capture_default_str();
  app->add_flag("--fixed", args->fixed,
                "A fixed group (any failure ends the job), as when the chief hosts it");
  app->add_flag("--insecure", args->insecure,
                "Without a cluster token, listen on an address other hosts reach anyway");
  app->add_option("--etcd", args->etcd,
                  "etcd://HOST:PORT,...[/JOB]: serve as one of several replicas, elected through "
                  "that etcd cluster; every task gets FLOTILLA_RENDEZVOUS=<the same URL>. "
                  "etcds://... for TLS");
  app->add_option("--etcd-cacert", args->etcd_cacert,
                  "PEM file of the CA that signed etcd's certificates (TLS; default: the "
                  "system's CAs, or FLOTILLA_ETCD_CACERT)");
  app->add_option("--etcd-cert", args->etcd_cert,
                  "PEM file of this client's certificate, for an etcd that asks for one (TLS; "
                  "or FLOTILLA_ETCD_CERT)");
  app->add_option("--etcd-key", args->etcd_key,
                  "PEM file of that certificate's private key (or FLOTILLA_ETCD_KEY)");
  app->add_option("--etcd-user", args->etcd_user,
                  "etcd user to authenticate as (or FLOTILLA_ETCD_USER); its password from "
                  "FLOTILLA_ETCD_PASSWORD, never a flag");
  app->footer("Example: flotilla rendezvous --listen 10.0.0.9:29400 --workers 4, and "
              "FLOTILLA_RENDEZVOUS=10.0.0.9:29400 in every task's environment");
  return {app, [args] { return run(*args); }};
}

} // namespace flotilla::tools
