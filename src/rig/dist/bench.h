// `rig bench comm`: a sweep of message sizes per collective with nccl-tests' columns (size,
// count, type, time, algbw, busbw) and a closed-form correctness check at every size.
#pragma once
#include <string>
#include <vector>

#include "rig/dist/communicator.h"

namespace rig::dist {

struct CommBenchOptions {
  std::vector<std::string> ops{"all_reduce"};  // all_reduce, reduce_scatter, all_gather, broadcast
  size_t min_bytes = 1 << 10;
  size_t max_bytes = 64 << 20;
  int factor = 2;   // size step
  int iters = 20;
  int warmup = 5;
};

struct CommBenchRow {
  std::string op;
  size_t bytes = 0;    // as nccl-tests: the whole buffer (all_gather's output, reduce_scatter's input)
  int64_t count = 0;   // elements per rank's send buffer for reduce_scatter/all_gather
  std::string type = "float";
  double time_us = 0;  // mean per collective, the slowest rank's
  double algbw = 0;    // GB/s = bytes / time
  double busbw = 0;    // algbw * busbw_factor
  int64_t wrong = 0;   // elements that differ from the closed form (on any rank)
};

// Every rank calls this with the same options; all get the same rows.
std::vector<CommBenchRow> bench_comm(Communicator& comm, const CommBenchOptions& opts);

// The ops for "--op all".
std::vector<std::string> all_comm_ops();

}  // namespace rig::dist
