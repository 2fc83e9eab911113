#include "rig/ops/profile.h"

#include <algorithm>
#include <chrono>
#include <nlohmann/json.hpp>

#include "rig/core/error.h"
#ifdef RIG_WITH_CUDA
#include "rig/core/cuda_check.h"
#include "rig/ops/cuda/context.h"
#endif

namespace rig::ops {

namespace {

using Clock = std::chrono::steady_clock;

struct Pending {
  std::string op, category;
  bool cuda = false;
  int device = -1;
  double host_start = 0, host_end = 0;
#ifdef RIG_WITH_CUDA
  cudaEvent_t start = nullptr, end = nullptr;
#endif
};

struct State {
  bool open = false;
  int device = -1;
  Clock::time_point t0;
  std::vector<Pending> pending;
#ifdef RIG_WITH_CUDA
  cudaEvent_t base = nullptr;
  std::vector<cudaEvent_t> pool;  // events kept between profiles
  cudaEvent_t event() {
    if (!pool.empty()) {
      cudaEvent_t e = pool.back();
      pool.pop_back();
      return e;
    }
    cudaEvent_t e;
    RIG_CUDA_CHECK(cudaEventCreate(&e));
    return e;
  }
#endif
  int depth = 0;  // ops called from inside ops are not counted twice
};

State& state() {
  static thread_local State s;
  return s;
}

double since(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

}  // namespace

double Profile::op_ms() const {
  double s = 0;
  for (const auto& [c, ms] : category_ms) s += ms;
  return s;
}

double Profile::between_ops_ms() const {
  std::vector<std::pair<double, double>> iv;
  for (const auto& s : spans) iv.emplace_back(s.start_ms, s.end_ms);
  if (iv.empty()) return 0;
  std::sort(iv.begin(), iv.end());
  double gaps = 0, reach = iv.front().second;
  for (const auto& [a, b] : iv) {
    if (a > reach) gaps += a - reach;
    reach = std::max(reach, b);
  }
  return gaps;
}

std::string Profile::chrome_trace() const {
  nlohmann::json ev = nlohmann::json::array();
  for (const auto& s : spans)
    ev.push_back({{"name", s.op},
                  {"cat", s.category},
                  {"ph", "X"},
                  {"pid", 0},
                  {"tid", 0},
                  {"ts", s.start_ms * 1e3},
                  {"dur", (s.end_ms - s.start_ms) * 1e3}});
  return nlohmann::json{{"traceEvents", ev}, {"displayTimeUnit", "ms"}}.dump();
}

bool profiling() {
  return state().open;
}

void profile_open(int device) {
  State& s = state();
  RIG_CHECK(!s.open, "a profile is already open");
  s.open = true;
  s.device = device;
  s.pending.clear();
#ifdef RIG_WITH_CUDA
  if (device >= 0) {
    cuda::DeviceGuard g(device);
    RIG_CUDA_CHECK(cudaStreamSynchronize(cuda::stream_for(device)));
    if (!s.base) s.base = s.event();
    RIG_CUDA_CHECK(cudaEventRecord(s.base, cuda::stream_for(device)));
  }
#endif
  s.t0 = Clock::now();
}

Profile profile_close() {
  State& s = state();
  RIG_CHECK(s.open, "no profile is open");
  Profile p;
#ifdef RIG_WITH_CUDA
  if (s.device >= 0) {
    cuda::DeviceGuard g(s.device);
    RIG_CUDA_CHECK(cudaStreamSynchronize(cuda::stream_for(s.device)));
  }
#endif
  p.wall_ms = since(s.t0);
  for (auto& e : s.pending) {
    OpSpan span{e.op, e.category, e.host_start, e.host_end};
#ifdef RIG_WITH_CUDA
    if (e.cuda) {
      float a = 0, b = 0;
      RIG_CUDA_CHECK(cudaEventElapsedTime(&a, s.base, e.start));
      RIG_CUDA_CHECK(cudaEventElapsedTime(&b, s.base, e.end));
      span.start_ms = a;
      span.end_ms = b;
      s.pool.push_back(e.start);
      s.pool.push_back(e.end);
    }
#endif
    p.category_ms[span.category] += span.end_ms - span.start_ms;
    p.spans.push_back(std::move(span));
  }
  s.pending.clear();
  s.open = false;
  return p;
}

OpScope::OpScope(const char* op, const char* category, bool cuda, int device) {
  State& s = state();
  if (!s.open || s.depth++ > 0) return;
  Pending e;
  e.op = op;
  e.category = category;
  e.cuda = cuda;
  e.device = device;
#ifdef RIG_WITH_CUDA
  if (cuda) {
    e.start = s.event();
    e.end = s.event();
    RIG_CUDA_CHECK(cudaEventRecord(e.start, cuda::stream_for(device)));
  }
#endif
  e.host_start = since(s.t0);
  s.pending.push_back(std::move(e));
  index_ = int(s.pending.size()) - 1;
}

OpScope::~OpScope() {
  State& s = state();
  if (!s.open) return;
  --s.depth;
  if (index_ < 0) return;
  Pending& e = s.pending[size_t(index_)];
  e.host_end = since(s.t0);
#ifdef RIG_WITH_CUDA
  if (e.cuda) cudaEventRecord(e.end, cuda::stream_for(e.device));
#endif
}

}  // namespace rig::ops
