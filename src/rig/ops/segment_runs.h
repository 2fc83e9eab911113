// Packed rows' segments as runs: the maximal stretches of one segment id along each row. The model
// renumbers segment ids by them, and cuDNN's packed attention makes each run a batch entry.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace rig::ops {

struct SegmentRuns {
  std::vector<int64_t> start, len;  // each run's first token (b*T + t) and length, row by row
  std::string repeat;  // non-empty when an id comes back after another in its row: where
};

// ids: segment ids [B, T] on the host.
SegmentRuns segment_runs(const int64_t* ids, int64_t B, int64_t T);

}  // namespace rig::ops
