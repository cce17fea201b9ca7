#include "flotilla/base/system.h"

#include <sched.h>

#include <algorithm>

namespace flotilla::base {

int available_cores() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof set, &set) == 0) return std::max(1, CPU_COUNT(&set));
  return 1;
}

} // namespace flotilla::base
