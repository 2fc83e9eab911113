// The CPU forward of every case of tests/op_cases.h that carries an independent float64
// reference (ops without a backward, which the finite differences cannot check) against that
// reference: the CPU backend is the GPU harness's oracle, so it is checked here, where CI runs.
#include <gtest/gtest.h>

#include <algorithm>
#include <vector>

#include "../op_cases.h"

namespace rig::test {
namespace {

std::vector<size_t> reference_cases() {
  std::vector<size_t> v;
  for (size_t i = 0; i < op_cases().size(); ++i)
    if (op_cases()[i].reference) v.push_back(i);
  return v;
}

class OpReference : public ::testing::TestWithParam<size_t> {};

// Float32 against float64: the float32 sums (lengths up to ~10^3 keys by 256 dims) round at
// ~2^-24 per operation, far under the F32 tolerance of 1e-5.
TEST_P(OpReference, CpuForwardMatchesTheReference) {
  const OpCase& c = op_cases()[GetParam()];
  const Tensors in = make_inputs(c, DType::F32, uint32_t(2000 + GetParam()));
  const Tensors got = c.forward(in, Ctx{Device::cpu(), DType::F32});
  for (const auto& [name, want] : c.reference(in)) {
    ASSERT_TRUE(got.count(name)) << name;
    const Compared r = compare(got.at(name), want, tolerance(DType::F32));
    EXPECT_TRUE(r.failure.empty())
        << c.op << " [" << c.shape << "] '" << name << "': " << r.failure;
  }
}

INSTANTIATE_TEST_SUITE_P(Ops, OpReference, ::testing::ValuesIn(reference_cases()),
                         [](const ::testing::TestParamInfo<size_t>& p) {
                           return case_name(op_cases()[p.param], p.param);
                         });

// The decode cases tell apart the kernels one would get wrong: a query head reading the wrong kv
// head, and rows that miss the newest cache row. Each is imitated by editing the cache the
// correct CPU op reads, and must fail against the reference of the unedited cache.
TEST(OpReference, DecodeCasesCatchWrongKernels) {
  int checked = 0;
  for (size_t i = 0; i < op_cases().size(); ++i) {
    const OpCase& c = op_cases()[i];
    if (c.op != "attention_decode") continue;
    const Tensors in = make_inputs(c, DType::F32, uint32_t(2000 + i));
    const Tensor want = c.reference(in).at("out");
    const int64_t past = int64_t(values(in.at("past"))[0]), n = in.at("q").dim(0);
    const int64_t Hk = in.at("k_cache").dim(1), D = in.at("k_cache").dim(2);
    auto fails = [&](const Tensors& edited) {
      return !compare(c.forward(edited, Ctx{Device::cpu(), DType::F32}).at("out"), want,
                      tolerance(DType::F32))
                  .failure.empty();
    };
    if (Hk > 1) {  // kv heads 0 and 1 swapped in every used row of both caches
      Tensors e = in;
      for (const char* name : {"k_cache", "v_cache"}) {
        e[name] = in.at(name).clone();
        float* x = e[name].f32();
        for (int64_t j = 0; j < past + n; ++j)
          std::swap_ranges(x + j * Hk * D, x + j * Hk * D + D, x + j * Hk * D + D);
      }
      EXPECT_TRUE(fails(e)) << c.shape << ": wrong kv head";
    }
    {  // the newest row's value replaced by its predecessor's (zeros for the first)
      Tensors e = in;
      e["v_cache"] = in.at("v_cache").clone();
      float* v = e["v_cache"].f32() + (past + n - 1) * Hk * D;
      for (int64_t x = 0; x < Hk * D; ++x) v[x] = past + n > 1 ? v[x - Hk * D] : 0.0f;
      EXPECT_TRUE(fails(e)) << c.shape << ": newest row missed";
    }
    ++checked;
  }
  EXPECT_GE(checked, 4);
}

}  // namespace
}  // namespace rig::test
