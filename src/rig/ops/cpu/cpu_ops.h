// float32 CPU implementations behind ops.h.
#pragma once
#include "rig/ops/ops.h"

namespace rig::ops::cpu {
void gemm(const Tensor& a, bool ta, const Tensor& b, bool tb, Tensor& c, float alpha, float beta);
void gemm_bias(const Tensor& a, bool ta, const Tensor& b, bool tb, Tensor& c, const Tensor& bias);
void gemm_plus(const Tensor& a, bool ta, const Tensor& b, bool tb, const Tensor& src, Tensor& out,
               float alpha, float beta);
void add_bias(Tensor& y, const Tensor& bias);
void bias_backward(const Tensor& dy, Tensor& dbias);
void embedding_forward(const Tensor& ids, const Tensor& table, Tensor& out);
void embedding_backward(const Tensor& ids, const Tensor& dout, Tensor& dtable);
void rmsnorm_forward(const Tensor& x, const Tensor& w, float eps, Tensor& y, Tensor& rstd);
void rmsnorm_backward(const Tensor& dy, const Tensor& x, const Tensor& w, const Tensor& rstd,
                      Tensor& dx, Tensor& dw);
void rmsnorm_backward_add(const Tensor& dy, const Tensor& x, const Tensor& w, const Tensor& rstd,
                          Tensor& dh, Tensor* dh_copy, Tensor* dw);
void rope(Tensor& x, const Tensor& pos, const Tensor& cos, const Tensor& sin, int heads,
          bool backward);
void attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& seg,
                       Tensor& out, Tensor& lse);
void attention_backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                        const Tensor& seg, const Tensor& out, const Tensor& lse, Tensor& dq,
                        Tensor& dk, Tensor& dv);
void swiglu_forward(const Tensor& g, const Tensor& u, Tensor& a);
void swiglu_backward(const Tensor& da, const Tensor& g, const Tensor& u, Tensor& dg, Tensor& du);
double cross_entropy(const Tensor& logits, const Tensor& targets, float grad_scale,
                     Tensor* dlogits, int64_t* valid);
void add_(Tensor& a, const Tensor& b, float alpha);
void scale_(Tensor& a, float s);
double sum_squares(const Tensor& a);
std::vector<double> sum_squares_list(const std::vector<Tensor>& ts);
void cast(const Tensor& src, Tensor& dst);
void dropout(const Tensor& x, float p, uint64_t seed, Tensor& out);
void adamw_step(Tensor& param, const Tensor& grad, Tensor& m, Tensor& v, const AdamWParams& h);
void adamw_step_list(std::vector<AdamWSlot>& slots, const AdamWParams& h, float grad_scale);
int64_t count_bad_values(const std::vector<Tensor>& ts, double max_abs);
uint64_t hash64(const std::vector<Tensor>& ts);
}  // namespace rig::ops::cpu
