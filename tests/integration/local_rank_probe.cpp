// A worker that only says where it is: what cluster::local_rank and local_world_size read from
// the real process environment (Environment::from_process), for the launch test.
#include <cstdio>

#include "flotilla/cluster/resolvers.h"

int main() {
  const auto env = flotilla::cluster::Environment::from_process();
  std::printf("local_rank=%d local_world_size=%d\n", flotilla::cluster::local_rank(env),
              flotilla::cluster::local_world_size(env));
  return 0;
}
