// The generic op harness (after ggml's test-backend-ops): one table of cases, each an op of
// src/rig/ops/op_table.inc at one shape, with its forward and (where the op has one) backward.
// tests/gpu/op_backend_test.cpp runs every case on every backend and dtype against the CPU
// float32 oracle; tests/unit/op_gradient_test.cpp checks the CPU backward of the small cases
// against central finite differences of the CPU forward. Adding an op = one case per shape.
//
// Not cases here, because the comparison they need is not "same values within a tolerance":
// cast (bitwise), dropout (the CUDA mask differs from the CPU one by design), adamw_step and the
// list ops (multi-step state, the update compared rather than the parameter; sum_squares_list,
// count_bad_values, hash64) and the forced attention implementations: their own tests in
// tests/gpu/op_harness_*test.cpp and tests/unit.
//
// The pieces are in op_cases_core.h, the cases in op_cases_basic.h and op_cases_layers.h.
#pragma once
#include <cctype>
#include <string>
#include <vector>

#include "op_cases_basic.h"
#include "op_cases_core.h"
#include "op_cases_layers.h"

namespace rig::test {

// Every case, in a fixed order (seeds derive from the position).
inline const std::vector<OpCase>& op_cases() {
  static const std::vector<OpCase> cs = [] {
    std::vector<OpCase> v;
    add_gemm_cases(v);
    add_elementwise_cases(v);
    add_norm_rope_cases(v);
    add_attention_cases(v);
    add_attention_decode_cases(v);
    add_loss_cases(v);
    add_argmax_cases(v);  // last: the cases above keep their positions (and seeds)
    return v;
  }();
  return cs;
}

// A gtest-safe name: op and shape, letters and digits only.
inline std::string case_name(const OpCase& c, size_t index) {
  std::string s = c.op + "_" + c.shape;
  std::string out;
  for (char ch : s) {
    if (std::isalnum(static_cast<unsigned char>(ch)))
      out += ch;
    else if (!out.empty() && out.back() != '_')
      out += '_';
  }
  while (!out.empty() && out.back() == '_') out.pop_back();
  return out + "_" + std::to_string(index);
}

}  // namespace rig::test
