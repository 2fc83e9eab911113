// The op set of the LLaMA family, forward and backward. Every op dispatches on the device of its
// tensors to ops/cpu (float32, the oracle) or ops/cuda (bf16 activations, fp32 accumulation).
// The ops and their contracts are the rows of op_table.inc; this header declares them.
#pragma once
#include <vector>

#include "rig/core/tensor.h"

namespace rig::ops {

// Process-wide: prefer bitwise-repeatable GPU kernels where a faster nondeterministic one exists
// (the training config's `deterministic`). The CPU backend is deterministic regardless.
void set_deterministic(bool on);

// torch.optim.AdamW's hyperparameters (adamw_step, adamw_step_list).
struct AdamWParams {
  float lr, beta1, beta2, eps, weight_decay;
  int64_t step;
};
// One tensor of adamw_step_list: its own weight decay and an optional BF16 copy to refresh.
struct AdamWSlot {
  Tensor param, grad, m, v, copy;
  float weight_decay = 0;
};

#define RIG_OP(ret, name, category, device_of, params, args) ret name params;
#define RIG_OP_CUSTOM(ret, name, params) ret name params;
#define RIG_OP_VIA(ret, name, category, device_of, params, backend_call) ret name params;
#include "rig/ops/op_table.inc"

// Default arguments (added to the table's declarations).
void add_(Tensor& a, const Tensor& b, float alpha = 1.0f);
int64_t count_bad_values(const std::vector<Tensor>& ts, double max_abs = 0);
inline bool all_finite(const std::vector<Tensor>& ts) {
  return count_bad_values(ts) == 0;
}

}  // namespace rig::ops
