// The op set of the LLaMA family, forward and backward. One declaration each; every op dispatches
// on the device of its tensors to ops/cpu (float32, the oracle) or ops/cuda (bf16 activations,
// fp32 accumulation). Tensors are contiguous; activations are [rows, features] with rows = B*T.
#pragma once
#include <vector>

#include "rig/core/tensor.h"

namespace rig::ops {

// Process-wide: prefer bitwise-repeatable GPU kernels where a faster nondeterministic one exists
// (the training config's `deterministic`). The CPU backend is deterministic regardless.
void set_deterministic(bool on);

// C = alpha * op(A) @ op(B) + beta * C, 2-D tensors; op(X) = X^T when the flag is set.
void gemm(const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, Tensor& c, float alpha,
          float beta);
// out = alpha * op(A) @ op(B) + beta * src, src and out of one shape and dtype (out may be src).
// The residual stream's add rides the product: no separate pass over it.
void gemm_plus(const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, const Tensor& src,
               Tensor& out, float alpha, float beta);
// C = op(A) @ op(B) + bias[None, :] (beta 0); on CUDA the bias rides cuBLASLt's epilogue.
void gemm_bias(const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, Tensor& c, const Tensor& bias);
// y[r, :] += bias; db[:] += sum_r dy[r, :]
void add_bias(Tensor& y, const Tensor& bias);
void bias_backward(const Tensor& dy, Tensor& dbias);

void embedding_forward(const Tensor& ids, const Tensor& table, Tensor& out);
void embedding_backward(const Tensor& ids, const Tensor& dout, Tensor& dtable);  // accumulates

// y = x / sqrt(mean(x^2) + eps) * w; rstd [rows] saved for backward.
void rmsnorm_forward(const Tensor& x, const Tensor& w, float eps, Tensor& y, Tensor& rstd);
// dx = (written), dw += (accumulated)
void rmsnorm_backward(const Tensor& dy, const Tensor& x, const Tensor& w, const Tensor& rstd,
                      Tensor& dx, Tensor& dw);

// The same backward added into the residual gradient, in one pass: dh += dx. dh_copy, when
// given, receives the updated dh in its own dtype (the compute-dtype operand of the next
// products); dw, when given, accumulates as above (a frozen norm passes none).
void rmsnorm_backward_add(const Tensor& dy, const Tensor& x, const Tensor& w, const Tensor& rstd,
                          Tensor& dh, Tensor* dh_copy, Tensor* dw);

// Rotary embedding in Hugging Face's half-split layout, in place on x [rows, heads*head_dim];
// cos/sin tables are [positions, head_dim/2]; pos [rows] int64.
void rope_forward(Tensor& x, const Tensor& pos, const Tensor& cos, const Tensor& sin, int heads);
void rope_backward(Tensor& dx, const Tensor& pos, const Tensor& cos, const Tensor& sin, int heads);

// Causal attention with grouped kv heads. q [B,T,Hq,D], k/v [B,T,Hk,D]; seg [B,T] int64 or
// undefined: a position attends only to earlier positions of the same segment (packing).
// lse [B,Hq,T] float32 (log-sum-exp of the scaled scores) is saved for backward.
void attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& seg,
                       Tensor& out, Tensor& lse);
void attention_backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                        const Tensor& seg, const Tensor& out, const Tensor& lse, Tensor& dq,
                        Tensor& dk, Tensor& dv);

// a = silu(g) * u
void swiglu_forward(const Tensor& g, const Tensor& u, Tensor& a);
void swiglu_backward(const Tensor& da, const Tensor& g, const Tensor& u, Tensor& dg, Tensor& du);

// Cross-entropy of logits [rows, V] against targets [rows] int64 (-100: ignored). Writes
// dlogits = (softmax - onehot) * grad_scale on valid rows, 0 elsewhere (dlogits may alias logits,
// or, on CUDA, have another dtype: the bf16 operand of the products that follow).
// Returns the summed loss over valid rows (double) and adds their count to *valid.
double cross_entropy(const Tensor& logits, const Tensor& targets, float grad_scale,
                     Tensor* dlogits, int64_t* valid);

// Element-wise helpers.
void add_(Tensor& a, const Tensor& b, float alpha = 1.0f);  // a += alpha * b
void scale_(Tensor& a, float s);
double sum_squares(const Tensor& a);  // in double
// sum_squares of each tensor of a list (on CUDA one read back for the whole list).
std::vector<double> sum_squares_list(const std::vector<Tensor>& ts);
// dst = src converted to dst's dtype (F32 <-> BF16), same element count; rounds to nearest even.
void cast(const Tensor& src, Tensor& dst);
// Dropout: out = x * mask / (1 - p), mask drawn from (seed, offset); p = 0 copies.
void dropout(const Tensor& x, float p, uint64_t seed, Tensor& out);

// torch.optim.AdamW, one tensor; `step` counts from 1.
struct AdamWParams {
  float lr, beta1, beta2, eps, weight_decay;
  int64_t step;
};
void adamw_step(Tensor& param, const Tensor& grad, Tensor& m, Tensor& v, const AdamWParams& h);
// AdamW over many tensors in one pass (on CUDA one launch per few dozen tensors), as torch's
// multi-tensor AdamW after clip_grad_norm_: each gradient is used as grad * grad_scale (the
// clipping coefficient; the gradient itself is not written), each slot decays by its own
// weight_decay (h.weight_decay is not used), and a defined `copy` (BF16, same size) receives the
// updated parameter: the compute weights refreshed in the same pass.
struct AdamWSlot {
  Tensor param, grad, m, v, copy;
  float weight_decay = 0;
};
void adamw_step_list(std::vector<AdamWSlot>& slots, const AdamWParams& h, float grad_scale);

// The training guard's checks (docs/reliability.md). Each reads a list of tensors where they live
// (all on one device) and returns one number: on CUDA one kernel per tensor accumulates into a
// device word that is read back once, so the weights or gradients never travel to the host.
//
// Elements that are NaN or Inf, or whose magnitude is above max_abs when max_abs > 0, summed over
// the float tensors of the list (F32 and BF16; on the CPU also F16 and F64); integer tensors
// have none.
int64_t count_bad_values(const std::vector<Tensor>& ts, double max_abs = 0);
inline bool all_finite(const std::vector<Tensor>& ts) {
  return count_bad_values(ts) == 0;
}
// A 64-bit hash of the tensors' bytes, sensitive to their order in the list and to every bit
// (definition in ops/guard_hash.h); the CPU and CUDA backends give the same value.
uint64_t hash64(const std::vector<Tensor>& ts);

}  // namespace rig::ops
