// The training step: each layer's forward and backward, activation checkpointing, the chunked
// loss, and the hooks a distributed strategy uses.
#include <algorithm>
#include <cmath>
#include <vector>

#include "rig/model/llama_parts.h"
#include "rig/model/loss_chunk.h"
#include "rig/ops/segment_runs.h"

namespace rig {

using namespace llama_detail;

namespace llama_detail {

void linear_forward(const LinearRefs& L, float scale, float p, uint64_t seed, const Tensor& x,
                    Tensor& y, Tensor* xa, const Tensor* residual) {
  if (residual) {
    ops::gemm_plus(x, false, L.w, true, *residual, y, 1.0f, 1.0f);
    if (L.b.defined()) ops::add_bias(y, L.b);
  } else if (L.b.defined()) {
    ops::gemm_bias(x, false, L.w, true, y, L.b);
  } else {
    ops::gemm(x, false, L.w, true, y, 1.0f, 0.0f);
  }
  if (!L.a.defined()) return;
  Tensor xd = x;
  if (p > 0) {
    xd = fresh_like(x, x.shape(), "lora dropout");
    ops::dropout(x, p, seed, xd);
  }
  *xa = fresh_like(x, {x.dim(0), L.a.dim(0)}, "lora xa");
  ops::gemm(xd, false, L.a, true, *xa, 1.0f, 0.0f);
  ops::gemm(*xa, false, L.bl, true, y, scale, 1.0f);
}

void linear_backward(const LinearRefs& L, float scale, float p, uint64_t seed, const Tensor& x,
                     const Tensor& dy, const Tensor& xa, Tensor& dx, bool accumulate) {
  if (L.dw) ops::gemm(dy, true, x, false, *L.dw, 1.0f, 1.0f);
  if (L.db) ops::bias_backward(dy, *L.db);
  ops::gemm(dy, false, L.w, false, dx, 1.0f, accumulate ? 1.0f : 0.0f);
  if (!L.a.defined()) return;
  if (L.dbl) ops::gemm(dy, true, xa, false, *L.dbl, scale, 1.0f);
  Tensor dxa = fresh_like(x, xa.shape(), "lora dxa");
  ops::gemm(dy, false, L.bl, false, dxa, scale, 0.0f);
  Tensor xd = x;
  if (p > 0) {
    xd = fresh_like(x, x.shape(), "lora dropout");
    ops::dropout(x, p, seed, xd);
  }
  if (L.da) ops::gemm(dxa, true, xd, false, *L.da, 1.0f, 1.0f);
  if (p > 0) {
    Tensor dxd = fresh_like(x, x.shape(), "lora dx");
    ops::gemm(dxa, false, L.a, false, dxd, 1.0f, 0.0f);
    ops::dropout(dxd, p, seed, xd);  // the same mask and 1/(1-p)
    ops::add_(dx, xd);
  } else {
    ops::gemm(dxa, false, L.a, false, dx, 1.0f, 1.0f);
  }
}

}  // namespace llama_detail

void LlamaModel::layer_forward(int li, const Tensor& h_in, Acts& a, const TokenBatch& b,
                               uint64_t seed) {
  auto grad_of = [&](int idx) -> Tensor* {
    return idx >= 0 && params_[size_t(idx)].grad.defined() ? &params_[size_t(idx)].grad : nullptr;
  };
  Layer& L = *layers_[size_t(li)];
  const int64_t N = h_in.dim(0), H = cfg_.hidden_size, F = cfg_.intermediate_size;
  const int64_t B = b.input_ids.dim(0), T = b.input_ids.dim(1), D = cfg_.head_dim;
  const float eps = float(cfg_.rms_norm_eps);
  auto lin = [&](int p, const Tensor& x, Tensor& y, const Tensor* residual = nullptr) {
    Linear& l = L.proj[p];
    linear_forward(RIG_LIN(l), l.lora_scale, seed ? l.lora_dropout : 0.0f, mix_seed(seed, li, p), x,
                   y, &a.xa[p], residual);
  };
  a.h_in = h_in;
  a.xn1 = act({N, H}, "xn1");
  a.rstd1 = fresh_on(dev_, {N}, "rstd");
  ops::rmsnorm_forward(h_in, params_[size_t(L.in_norm)].value, eps, a.xn1, a.rstd1);
  a.q = act({N, cfg_.q_dim()}, "q");
  a.k = act({N, cfg_.kv_dim()}, "k");
  a.v = act({N, cfg_.kv_dim()}, "v");
  lin(Q, a.xn1, a.q);
  lin(K, a.xn1, a.k);
  lin(V, a.xn1, a.v);
  if (L.q_norm >= 0) {
    // qwen3: each head of q and k normalised (rows of head_dim) before RoPE.
    auto head_norm = [&](Tensor& x, Tensor& raw, Tensor& rstd, int norm) {
      raw = x;
      x = act(raw.shape(), "head norm");
      const int64_t rows = raw.numel() / D;
      rstd = fresh_on(dev_, {rows}, "rstd");
      Tensor y = x.reshape({rows, D});
      ops::rmsnorm_forward(raw.reshape({rows, D}), params_[size_t(norm)].value, eps, y, rstd);
    };
    head_norm(a.q, a.q_raw, a.rstd_q, L.q_norm);
    head_norm(a.k, a.k_raw, a.rstd_k, L.k_norm);
  }
  ops::rope_forward(a.q, cur_pos_, rope_cos_, rope_sin_, int(cfg_.num_heads));
  ops::rope_forward(a.k, cur_pos_, rope_cos_, rope_sin_, int(cfg_.num_kv_heads));
  a.attn = act({N, cfg_.q_dim()}, "attention out");
  a.lse = fresh_on(dev_, {B, cfg_.num_heads, T}, "attention lse");
  Tensor o4 = a.attn.reshape({B, T, cfg_.num_heads, D});
  ops::attention_forward(a.q.reshape({B, T, cfg_.num_heads, D}),
                         a.k.reshape({B, T, cfg_.num_kv_heads, D}),
                         a.v.reshape({B, T, cfg_.num_kv_heads, D}), b.segment_ids, o4, a.lse);
  a.h_mid = fresh_like(h_in, {N, H}, "residual");
  lin(O, a.attn, a.h_mid, &h_in);
  a.xn2 = act({N, H}, "xn2");
  a.rstd2 = fresh_on(dev_, {N}, "rstd");
  ops::rmsnorm_forward(a.h_mid, params_[size_t(L.post_norm)].value, eps, a.xn2, a.rstd2);
  a.g = act({N, F}, "gate");
  a.u = act({N, F}, "up");
  lin(GATE, a.xn2, a.g);
  lin(UP, a.xn2, a.u);
  a.act = act({N, F}, "swiglu");
  ops::swiglu_forward(a.g, a.u, a.act);
  a.h_out = fresh_like(h_in, {N, H}, "residual");
  lin(DOWN, a.act, a.h_out, &a.h_mid);
}

bool LlamaModel::reads_input(int li, int proj) const {
  const Linear& l = layers_[size_t(li)]->proj[proj];
  return params_[size_t(l.w)].trainable || l.lora_a >= 0;  // dW, or LoRA's dA (and x·A)
}

void LlamaModel::drop_saved(int li, Acts& a, Checkpointing mode) const {
  if (mode == Checkpointing::Full) {
    a.drop_all_but_input();
    return;
  }
  // What no backward product reads goes in every mode; selective drops the rest of the
  // element-wise outputs too and recomputes them (recompute_saved).
  const bool sel = mode == Checkpointing::Selective;
  if (sel || !(reads_input(li, Q) || reads_input(li, K) || reads_input(li, V))) a.xn1 = Tensor();
  if (sel || !(reads_input(li, GATE) || reads_input(li, UP))) a.xn2 = Tensor();
  if (sel || !reads_input(li, DOWN)) a.act = Tensor();
}

void LlamaModel::recompute_saved(int li, Acts& a) {
  Layer& L = *layers_[size_t(li)];
  const int64_t N = a.h_in.dim(0), H = cfg_.hidden_size, F = cfg_.intermediate_size;
  const float eps = float(cfg_.rms_norm_eps);
  if (!a.xn1.defined() && (reads_input(li, Q) || reads_input(li, K) || reads_input(li, V))) {
    a.xn1 = act({N, H}, "xn1");
    ops::rmsnorm_forward(a.h_in, params_[size_t(L.in_norm)].value, eps, a.xn1, a.rstd1);
  }
  if (!a.xn2.defined() && (reads_input(li, GATE) || reads_input(li, UP))) {
    a.xn2 = act({N, H}, "xn2");
    ops::rmsnorm_forward(a.h_mid, params_[size_t(L.post_norm)].value, eps, a.xn2, a.rstd2);
  }
  if (!a.act.defined() && reads_input(li, DOWN)) {
    a.act = act({N, F}, "swiglu");
    ops::swiglu_forward(a.g, a.u, a.act);
  }
}

void LlamaModel::layer_backward(int li, Acts& a, Tensor& dh, Tensor& dh_act, const TokenBatch& b,
                                uint64_t seed) {
  auto grad_of = [&](int idx) -> Tensor* {
    return idx >= 0 && params_[size_t(idx)].grad.defined() ? &params_[size_t(idx)].grad : nullptr;
  };
  Layer& L = *layers_[size_t(li)];
  const int64_t N = dh.dim(0), H = cfg_.hidden_size, F = cfg_.intermediate_size;
  const int64_t B = b.input_ids.dim(0), T = b.input_ids.dim(1), D = cfg_.head_dim;
  auto lin_bwd = [&](int p, const Tensor& x, const Tensor& dy, Tensor& dx, bool acc) {
    Linear& l = L.proj[p];
    linear_backward(RIG_LIN(l), l.lora_scale, seed ? l.lora_dropout : 0.0f, mix_seed(seed, li, p),
                    x, dy, a.xa[p], dx, acc);
  };
  // dh += the norm's input gradient; dh_act, the products' operand, follows (when it is a copy).
  Tensor* dh_copy = dh_act.raw() == dh.raw() ? nullptr : &dh_act;
  auto norm_bwd = [&](const Tensor& dxn, const Tensor& x, int norm, const Tensor& rstd) {
    ops::rmsnorm_backward_add(dxn, x, params_[size_t(norm)].value, rstd, dh, dh_copy,
                              grad_of(norm));
  };
  // MLP. The residual gradient dh stays float32; the matrix products read dh_act.
  Tensor dact = act({N, F}, "d swiglu");
  lin_bwd(DOWN, a.act, dh_act, dact, false);
  Tensor dg = act({N, F}, "d gate"), du = act({N, F}, "d up");
  ops::swiglu_backward(dact, a.g, a.u, dg, du);
  dact = Tensor();
  Tensor dxn = fresh_on(dev_, {N, H}, "d xn2");
  lin_bwd(GATE, a.xn2, dg, dxn, false);
  lin_bwd(UP, a.xn2, du, dxn, true);
  dg = du = Tensor();
  norm_bwd(dxn, a.h_mid, L.post_norm, a.rstd2);
  // Attention
  Tensor dattn = act({N, cfg_.q_dim()}, "d attention");
  lin_bwd(O, a.attn, dh_act, dattn, false);
  Tensor dq = act({N, cfg_.q_dim()}, "dq"), dk = act({N, cfg_.kv_dim()}, "dk"),
         dv = act({N, cfg_.kv_dim()}, "dv");
  const int64_t Hq = cfg_.num_heads, Hk = cfg_.num_kv_heads;
  Tensor dq4 = dq.reshape({B, T, Hq, D}), dk4 = dk.reshape({B, T, Hk, D}),
         dv4 = dv.reshape({B, T, Hk, D});
  ops::attention_backward(dattn.reshape({B, T, Hq, D}), a.q.reshape({B, T, Hq, D}),
                          a.k.reshape({B, T, Hk, D}), a.v.reshape({B, T, Hk, D}), b.segment_ids,
                          a.attn.reshape({B, T, Hq, D}), a.lse, dq4, dk4, dv4);
  dattn = Tensor();
  ops::rope_backward(dq, cur_pos_, rope_cos_, rope_sin_, int(Hq));
  ops::rope_backward(dk, cur_pos_, rope_cos_, rope_sin_, int(Hk));
  if (L.q_norm >= 0) {
    // Through qwen3's head norms: the input gradient lands in a zeroed float32 buffer, copied
    // to the products' dtype where that differs.
    auto head_norm_bwd = [&](Tensor& d, const Tensor& raw, const Tensor& rstd, int norm) {
      const int64_t rows = raw.numel() / D;
      Tensor d32 = Tensor::zeros({rows, D}, DType::F32, dev_, "d head norm");
      Tensor dx = raw.dtype() == DType::F32 ? d32 : fresh_like(raw, {rows, D}, "d head norm");
      ops::rmsnorm_backward_add(d.reshape({rows, D}), raw.reshape({rows, D}),
                                params_[size_t(norm)].value, rstd, d32,
                                dx.raw() == d32.raw() ? nullptr : &dx, grad_of(norm));
      d = dx.reshape(raw.shape());
    };
    head_norm_bwd(dq, a.q_raw, a.rstd_q, L.q_norm);
    head_norm_bwd(dk, a.k_raw, a.rstd_k, L.k_norm);
  }
  lin_bwd(Q, a.xn1, dq, dxn, false);
  lin_bwd(K, a.xn1, dk, dxn, true);
  lin_bwd(V, a.xn1, dv, dxn, true);
  norm_bwd(dxn, a.h_in, L.in_norm, a.rstd1);
}

namespace {
// Segment ids as the attention kernels want them: each row's runs numbered 0, 1, 2, ... (the
// packer writes 1, 2, ... and 0 for trailing padding), so they never decrease along a row and
// the kernels can skip whole tiles before a segment's start; or no tensor at all when every row is
// one run, which is plain causal attention (the case cuDNN's fused kernel runs). Ids that come
// back after another run are kept as they are: renumbering would split their segment.
Tensor attention_segments(const Tensor& seg) {
  if (!seg.defined()) return seg;
  const int64_t B = seg.dim(0), T = seg.dim(1);
  const ops::SegmentRuns runs = ops::segment_runs(seg.data<int64_t>(), B, T);
  if (!runs.repeat.empty()) return seg;
  if (int64_t(runs.start.size()) == B) return Tensor();  // one run a row
  Tensor numbered = Tensor::empty(seg.shape(), DType::I64, Device::cpu(), "segment runs");
  int64_t* r = numbered.data<int64_t>();
  int64_t run = 0;
  for (size_t j = 0; j < runs.start.size(); ++j) {
    run = runs.start[j] % T == 0 ? 0 : run + 1;
    std::fill_n(r + runs.start[j], runs.len[j], run);
  }
  return numbered;
}

// The batch's shapes, and its token ids and labels against the vocabulary (on the host).
void check_batch(const TokenBatch& batch, int64_t vocab) {
  const Tensor& ids = batch.input_ids;
  RIG_CHECK(ids.ndim() == 2 && ids.dtype() == DType::I64,
            "input_ids must be int64 [B, T], got {} {}", dtype_name(ids.dtype()),
            shape_str(ids.shape()));
  RIG_CHECK(batch.labels.shape() == ids.shape() && batch.labels.dtype() == DType::I64,
            "labels must be int64 {}", shape_str(ids.shape()));
  check_vocab(ids.data<int64_t>(), ids.numel(), ids.dim(1), vocab, "token id", false);
  check_vocab(batch.labels.data<int64_t>(), ids.numel(), ids.dim(1), vocab, "label", true);
}

// Full checkpointing recomputes the first recompute_layers layers (all when negative); the others
// run selective.
Checkpointing mode_of(const StepOptions& opt, size_t l) {
  if (opt.checkpointing != Checkpointing::Full) return opt.checkpointing;
  return opt.recompute_layers < 0 || int64_t(l) < opt.recompute_layers ? Checkpointing::Full
                                                                       : Checkpointing::Selective;
}

// Position ids, given or 0..T-1 per row, flattened; *max_pos is the largest.
Tensor positions_of(const TokenBatch& batch, int64_t* max_pos) {
  const int64_t T = batch.input_ids.dim(1), N = batch.input_ids.numel();
  Tensor pos = Tensor::empty({N}, DType::I64, Device::cpu(), "positions");
  *max_pos = 0;
  for (int64_t r = 0; r < N; ++r) {
    int64_t p = batch.position_ids.defined() ? batch.position_ids.data<int64_t>()[r] : r % T;
    pos.data<int64_t>()[r] = p;
    *max_pos = std::max(*max_pos, p);
  }
  return pos;
}

// The loss's targets: labels shifted left by one (the last position of each row has none);
// *valid counts those not ignored.
Tensor shifted_targets(const Tensor& labels, int64_t* valid) {
  const int64_t T = labels.dim(1), N = labels.numel();
  Tensor targets = Tensor::empty({N}, DType::I64, Device::cpu(), "targets");
  *valid = 0;
  for (int64_t r = 0; r < N; ++r) {
    const int64_t lab = r % T + 1 < T ? labels.data<int64_t>()[r + 1] : -100;
    targets.data<int64_t>()[r] = lab;
    *valid += lab != -100;
  }
  return targets;
}
}  // namespace

namespace llama_detail {
void check_vocab(const int64_t* v, int64_t n, int64_t row_len, int64_t vocab, const char* what,
                 bool ignore_allowed) {
  for (int64_t r = 0; r < n; ++r)
    if ((v[r] < 0 || v[r] >= vocab) && !(ignore_allowed && v[r] == -100))
      bad_input("{} {} at row {} position {} is outside the vocabulary of {}", what, v[r],
                r / row_len, r % row_len, vocab);
}
}  // namespace llama_detail

StepResult LlamaModel::step(const TokenBatch& batch, const StepOptions& opt) {
  if (act_ != DType::F32 && !dev_.is_cuda())
    bad_input("bf16 compute needs a CUDA device; the CPU backend computes in float32");
  check_batch(batch, cfg_.vocab_size);
  const Tensor& ids = batch.input_ids;
  const int64_t B = ids.dim(0), T = ids.dim(1), N = B * T, H = cfg_.hidden_size;
  if (cfg_.sliding_window && T > *cfg_.sliding_window)
    bad_input(
        "sequence length {} exceeds the model's sliding window {}, which rig does not support yet",
        T, *cfg_.sliding_window);
  int64_t max_pos = 0;
  cur_pos_ = positions_of(batch, &max_pos);
  ensure_rope(max_pos + 1);
  cur_pos_ = cur_pos_.to(dev_, "positions");
  // The batch arrives on the host; the layers need ids and segments where they run.
  const TokenBatch& host = batch;
  TokenBatch dbatch{
      ids.to(dev_, "input ids"), host.labels, {}, attention_segments(host.segment_ids)};
  if (dbatch.segment_ids.defined()) dbatch.segment_ids = dbatch.segment_ids.to(dev_, "segments");
  const uint64_t seed = opt.backward ? opt.dropout_seed : 0;

  StepHooks* hk = opt.hooks;
  const auto phase = opt.backward ? StepHooks::Backward : StepHooks::Forward;
  if (hk) {
    hk->before(-1, phase);
    bind_outer();
  }
  Tensor h = fresh_on(dev_, {N, H}, "embeddings");
  ops::embedding_forward(dbatch.input_ids.reshape({N}), embed_, h);
  if (hk) {
    hk->outer_done(StepHooks::Embedding);
    bind_outer();
  }
  std::vector<Acts> acts(layers_.size());
  for (size_t l = 0; l < layers_.size(); ++l) {
    if (hk) hk->before(int(l), StepHooks::Forward);
    layer_forward(int(l), h, acts[l], dbatch, seed);
    if (hk) hk->after(int(l), StepHooks::Forward);
    h = acts[l].h_out;
    if (opt.backward) {
      drop_saved(int(l), acts[l], mode_of(opt, l));
    } else {
      acts[l] = Acts{};
    }
  }
  if (hk) {
    hk->outer_needed(StepHooks::Head);
    bind_outer();
  }
  Tensor hn = act({N, H}, "final norm"), rstd = fresh_on(dev_, {N}, "rstd");
  ops::rmsnorm_forward(h, final_norm_, float(cfg_.rms_norm_eps), hn, rstd);

  StepResult res;
  Tensor targets = shifted_targets(batch.labels, &res.tokens).to(dev_, "targets");
  const float scale =
      opt.grad_scale > 0 ? opt.grad_scale : (res.tokens ? 1.0f / float(res.tokens) : 0.0f);
  // Per-row losses stay on the device and are read once, after the whole step is queued.
  Tensor row_loss = fresh_on(dev_, {N}, "row losses");
  if (opt.logits)
    *opt.logits = Tensor::empty({B, T, cfg_.vocab_size}, DType::F32, Device::cpu(), "logits");
  Tensor dhn = head_and_loss(hn, targets, scale, opt, row_loss);
  hn = Tensor();
  if (opt.backward) {
    backward(acts, dhn, h, rstd, dbatch, seed, opt);
  } else if (hk) {
    hk->outer_done(StepHooks::Head);
    bind_outer();
  }
  if (hk) {
    hk->after(-1, phase);
    bind_outer();
  }
  Tensor losses = row_loss.to(Device::cpu(), "row losses");
  for (int64_t i = 0; i < N; ++i) res.loss_sum += double(losses.f32()[i]);
  return res;
}

// From the gradient of the final norm's output down to the embedding: each layer recomputes what
// its checkpointing mode dropped, then runs its backward.
void LlamaModel::backward(std::vector<Acts>& acts, Tensor& dhn, const Tensor& h, const Tensor& rstd,
                          const TokenBatch& dbatch, uint64_t seed, const StepOptions& opt) {
  const int64_t N = h.dim(0), H = h.dim(1);
  StepHooks* hk = opt.hooks;
  Tensor dh = fresh_on(dev_, {N, H}, "d hidden");
  Param* fn = find_param("model.norm.weight");
  Tensor dfn =
      fn->grad.defined() ? fn->grad : Tensor::zeros(fn->value.shape(), DType::F32, dev_, "frozen");
  ops::rmsnorm_backward(dhn, h, final_norm_, rstd, dh, dfn);
  dhn = Tensor();
  if (hk) {
    hk->outer_done(StepHooks::Head);
    bind_outer();
  }
  Tensor dh_act = act_ == DType::F32 ? dh : act({N, H}, "d hidden operand");
  if (dh_act.raw() != dh.raw()) ops::cast(dh, dh_act);
  for (int l = int(layers_.size()) - 1; l >= 0; --l) {
    if (hk) hk->before(l, StepHooks::Backward);
    if (mode_of(opt, size_t(l)) == Checkpointing::Full) {
      layer_forward(l, acts[size_t(l)].h_in, acts[size_t(l)], dbatch, seed);
    } else {
      recompute_saved(l, acts[size_t(l)]);
    }
    layer_backward(l, acts[size_t(l)], dh, dh_act, dbatch, seed);
    acts[size_t(l)] = Acts{};
    if (hk) hk->after(l, StepHooks::Backward);
  }
  if (params_.front().grad.defined())
    ops::embedding_backward(dbatch.input_ids.reshape({N}), dh, params_.front().grad);
}

// The LM head and the loss in row chunks (the logits of the whole batch never exist at once);
// with a backward, returns the gradient of the final norm's output (float32 [N, H]).
Tensor LlamaModel::head_and_loss(const Tensor& hn, const Tensor& targets, float scale,
                                 const StepOptions& opt, Tensor& row_loss) {
  if (opt.hooks && opt.hooks->head_slices() > 0)
    return head_and_loss_sliced(hn, targets, scale, opt, row_loss);
  const int64_t N = hn.dim(0), H = hn.dim(1), Vv = cfg_.vocab_size;
  Param* head = cfg_.tie_word_embeddings ? &params_.front() : find_param("lm_head.weight");
  Tensor dhn = opt.backward ? Tensor::zeros({N, H}, DType::F32, dev_, "d final norm") : Tensor();
  // Logits in the products' dtype, as transformers computes them under autocast (the loss reads
  // them in float32), with their gradient written over them; float32 when the caller keeps them.
  const DType logit_dt = opt.logits ? DType::F32 : act_;
  const int64_t chunk = opt.loss_chunk_rows > 0
                            ? opt.loss_chunk_rows
                            : loss_chunk_rows_for(Vv, int64_t(dtype_size(logit_dt)));
  for (int64_t r0 = 0; r0 < N; r0 += chunk) {
    const int64_t r1 = std::min(N, r0 + chunk);
    Tensor x = hn.slice_rows(r0, r1);
    Tensor logits = Tensor::empty({r1 - r0, Vv}, logit_dt, dev_, "logits chunk");
    ops::gemm(x, false, lm_head_, true, logits, 1.0f, 0.0f);
    if (opt.logits) opt.logits->reshape({N, Vv}).slice_rows(r0, r1).copy_from(logits);
    Tensor tg = targets.slice_rows(r0, r1), rl = row_loss.slice_rows(r0, r1);
    Tensor dl = !opt.backward      ? Tensor()
                : logit_dt == act_ ? logits
                                   : act(logits.shape(), "d logits");
    ops::cross_entropy(logits, tg, scale, opt.backward ? &dl : nullptr, rl);
    if (!opt.backward) continue;
    Tensor dx = dhn.slice_rows(r0, r1);
    ops::gemm(dl, false, lm_head_, false, dx, 1.0f, 0.0f);
    if (head->grad.defined()) ops::gemm(dl, true, x, false, head->grad, 1.0f, 1.0f);
  }
  return dhn;
}

// Two passes over the slices: the forward folds each slice's logits into per-row (max, sum,
// target's logit); the backward gathers them again in reverse order (the last is still held),
// recomputes the logits and adds their gradient's product into dhn. The head is frozen here.
Tensor LlamaModel::head_and_loss_sliced(const Tensor& hn, const Tensor& targets, float scale,
                                        const StepOptions& opt, Tensor& row_loss) {
  StepHooks* hk = opt.hooks;
  const int K = hk->head_slices();
  const int64_t N = hn.dim(0), H = hn.dim(1);
  RIG_CHECK(!opt.logits, "the logits of a head read in slices are not kept");
  Tensor dhn = opt.backward ? Tensor::zeros({N, H}, DType::F32, dev_, "d final norm") : Tensor();
  std::vector<float> init(size_t(3 * N), 0.0f);
  for (int64_t r = 0; r < N; ++r) init[size_t(3 * r)] = -INFINITY;
  Tensor stats = Tensor::from_f32(init, {N, 3});
  if (!dev_.is_cpu()) stats = stats.to(dev_, "loss statistics");
  auto pass = [&](int c, int next, bool backward) {
    int64_t v0 = 0;
    Tensor w = hk->head_slice(c, next, v0);
    const int64_t Vc = w.dim(0);
    const int64_t chunk = opt.loss_chunk_rows > 0
                              ? opt.loss_chunk_rows
                              : loss_chunk_rows_for(Vc, int64_t(dtype_size(act_)));
    for (int64_t r0 = 0; r0 < N; r0 += chunk) {
      const int64_t r1 = std::min(N, r0 + chunk);
      Tensor x = hn.slice_rows(r0, r1), tg = targets.slice_rows(r0, r1);
      Tensor st = stats.slice_rows(r0, r1);
      Tensor logits = act({r1 - r0, Vc}, "logits slice");
      ops::gemm(x, false, w, true, logits, 1.0f, 0.0f);
      if (!backward) {
        ops::cross_entropy_slice(logits, tg, v0, st);
        continue;
      }
      ops::cross_entropy_slice_backward(logits, tg, v0, st, scale);
      Tensor dx = dhn.slice_rows(r0, r1);
      ops::gemm(logits, false, w, false, dx, 1.0f, 1.0f);
    }
  };
  for (int c = 0; c < K; ++c) {
    pass(c, c + 1 < K ? c + 1 : -1, false);
    if (!opt.backward || c + 1 < K) hk->head_slice_done(c);
  }
  ops::cross_entropy_finish(stats, targets, cfg_.vocab_size, row_loss);
  if (!opt.backward) return dhn;
  for (int c = K - 1; c >= 0; --c) {
    pass(c, c > 0 ? c - 1 : -1, true);
    hk->head_slice_done(c);
  }
  return dhn;
}

}  // namespace rig
