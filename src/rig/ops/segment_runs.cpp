#include "rig/ops/segment_runs.h"

#include <algorithm>

#include "rig/core/error.h"

namespace rig::ops {

SegmentRuns segment_runs(const int64_t* ids, int64_t B, int64_t T) {
  SegmentRuns r;
  for (int64_t b = 0; b < B; ++b) {
    std::vector<int64_t> seen;
    for (int64_t t = 0; t < T; ++t) {
      const int64_t i = b * T + t, id = ids[i];
      if (t > 0 && id == ids[i - 1]) {
        ++r.len.back();
        continue;
      }
      if (std::find(seen.begin(), seen.end(), id) != seen.end()) {
        r.repeat = fmt::format("segment id {} comes back after another in row {}", id, b);
        return r;
      }
      seen.push_back(id);
      r.start.push_back(i);
      r.len.push_back(1);
    }
  }
  return r;
}

}  // namespace rig::ops
