// The generic backend harness: every case of tests/op_cases.h on every available backend (today
// the CUDA one, device 0) and dtype it takes, against the CPU float32 oracle: forward, then
// backward from the CPU forward's saved outputs (rounded to the dtypes the backend's forward
// wrote), so that each comparison measures one kernel.
#include <gtest/gtest.h>

#include <cstdio>
#include <string>
#include <vector>

#include "../op_cases.h"

namespace rig::test {
namespace {

struct BackendCase {
  size_t index;
  DType dt;
};

std::vector<BackendCase> backend_cases() {
  std::vector<BackendCase> v;
  for (size_t i = 0; i < op_cases().size(); ++i)
    for (DType dt : op_cases()[i].dtypes) v.push_back({i, dt});
  return v;
}

// Compares every output; one line per case with the errors, one failure per output off. `in`:
// what the outputs were computed from (for the cases' term sizes).
void check(const OpCase& c, const char* phase, DType dt, const Device& dev, const Tensors& in,
           const Tensors& want, const Tensors& got, std::string& summary) {
  for (const auto& [name, w] : want) {
    const std::string where = fmt::format("{} [{}] {} on {}: {} output '{}'", c.op, c.shape,
                                          dtype_str(dt), dev.str(), phase, name);
    auto it = got.find(name);
    if (it == got.end()) {
      ADD_FAILURE() << where << ": missing";
      continue;
    }
    const double tol =
        c.exact.count(name) ? 0.0 : tolerance(c.f32_outputs.count(name) ? DType::F32 : dt);
    std::vector<double> terms;
    if (auto ts = c.term_size.find(name); ts != c.term_size.end()) terms = ts->second(in);
    const Compared r = compare(it->second, w, tol, terms.empty() ? nullptr : &terms);
    summary += fmt::format(" {}:{}={:.2g}/{:.2g}", phase, name, r.err, r.tol);
    if (!r.failure.empty()) ADD_FAILURE() << where << ": " << r.failure;
  }
}

class OpBackend : public ::testing::TestWithParam<BackendCase> {};

TEST_P(OpBackend, MatchesTheCpuOracle) {
  if (!cuda_available())
    GTEST_SKIP() << "no CUDA GPU: the generic harness compares the CUDA backend with the CPU "
                    "oracle and needs a visible GPU in a -DRIG_CUDA=ON build";
  const OpCase& c = op_cases()[GetParam().index];
  const DType dt = GetParam().dt;
  const Ctx cpu{Device::cpu(), DType::F32}, dev{Device::cuda(0), dt};
  const Tensors in = make_inputs(c, dt, uint32_t(GetParam().index + 17));
  const Tensors want = c.forward(in, cpu);
  const Tensors din = place_inputs(c, in, dev);
  const Tensors got = c.forward(din, dev);
  std::string summary;
  check(c, "forward", dt, dev.dev, in, want, got, summary);
  if (c.backward) {
    Tensors bin = in, bdin = din;
    for (const auto& [name, w] : want) {
      const DType odt = got.count(name) ? got.at(name).dtype() : w.dtype();
      const Tensor saved = odt == w.dtype() ? w : w.to_dtype(odt).to_dtype(w.dtype());
      bin.emplace(name, saved);
      bdin.emplace(name, place(saved, odt, dev.dev));
    }
    check(c, "backward", dt, dev.dev, bin, c.backward(bin, cpu), c.backward(bdin, dev), summary);
  }
  std::printf("%s [%s] %s:%s\n", c.op.c_str(), c.shape.c_str(), dtype_str(dt), summary.c_str());
}

INSTANTIATE_TEST_SUITE_P(Ops, OpBackend, ::testing::ValuesIn(backend_cases()),
                         [](const ::testing::TestParamInfo<BackendCase>& p) {
                           return case_name(op_cases()[p.param.index], p.param.index) + "_" +
                                  dtype_str(p.param.dt);
                         });

}  // namespace
}  // namespace rig::test
