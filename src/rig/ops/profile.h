// Where a step's time goes: while a profile is open, every op that goes through ops.h records its
// span (CUDA events on the op's stream for GPU tensors, the host clock for CPU ones) under a
// category. close() waits for the device and sums the spans; the rest of the step's wall time is
// time the device spent idle or in work that is not an op (communication, host code).
#pragma once
#include <map>
#include <string>
#include <vector>

namespace rig::ops {

struct OpSpan {
  std::string op, category;
  double start_ms, end_ms;  // from the profile's start
};

struct Profile {
  std::vector<OpSpan> spans;
  std::map<std::string, double> category_ms;  // summed span time per category
  double wall_ms = 0;                         // open() to close(), device work included
  double op_ms() const;                       // all categories
  // From the first op's start to the last op's end, the time no op was running: launch gaps
  // while the device waits for the host, and work that is not an op (copies, memsets). What
  // CUDA graphs could remove is at most this.
  double between_ops_ms() const;
  // Chrome trace / Perfetto JSON: one complete event per op.
  std::string chrome_trace() const;
};

// Starts recording (device: the CUDA device whose stream the ops use, or -1 for the CPU).
void profile_open(int device);
Profile profile_close();
bool profiling();

// Records one op's span for its lifetime while a profile is open (used by the op dispatch).
class OpScope {
 public:
  OpScope(const char* op, const char* category, bool cuda, int device);
  ~OpScope();
  OpScope(const OpScope&) = delete;
  OpScope& operator=(const OpScope&) = delete;

 private:
  int index_ = -1;
};

}  // namespace rig::ops
