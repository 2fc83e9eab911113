// Generation: the logits of the last token with a key/value cache.
#include <cmath>
#include <vector>

#include "rig/model/llama_parts.h"

namespace rig {

using namespace llama_detail;

LlamaModel::KVCache LlamaModel::new_cache(int64_t max_len) const {
  KVCache c;
  for (size_t l = 0; l < layers_.size(); ++l) {
    c.k.push_back(Tensor::zeros({max_len, cfg_.kv_dim()}, DType::F32, Device::cpu(), "kv cache"));
    c.v.push_back(Tensor::zeros({max_len, cfg_.kv_dim()}, DType::F32, Device::cpu(), "kv cache"));
  }
  return c;
}

std::vector<float> LlamaModel::decode(KVCache& cache, const std::vector<int64_t>& tokens) {
  auto grad_of = [](int) -> Tensor* { return nullptr; };
  const int64_t H = cfg_.hidden_size, F = cfg_.intermediate_size, D = cfg_.head_dim;
  const int64_t Hq = cfg_.num_heads, Hk = cfg_.num_kv_heads, group = Hq / Hk;
  const float eps = float(cfg_.rms_norm_eps);
  std::vector<float> logits(size_t(cfg_.vocab_size));
  bind_outer();
  for (int64_t tok : tokens) {
    const int64_t pos = cache.len;
    RIG_CHECK(pos < cache.k[0].dim(0), "KV cache full at {} tokens", pos);
    ensure_rope(pos + 1);
    Tensor posv = Tensor::empty({1}, DType::I64);
    posv.data<int64_t>()[0] = pos;
    Tensor idv = Tensor::empty({1}, DType::I64);
    idv.data<int64_t>()[0] = tok;
    Tensor h = fresh_on(dev_, {1, H}, "decode"), xn = act({1, H}, "decode"),
           rs = fresh_on(dev_, {1}, "decode");
    posv = posv.to(dev_, "position");
    idv = idv.to(dev_, "token");
    ops::embedding_forward(idv, embed_, h);
    for (size_t l = 0; l < layers_.size(); ++l) {
      Layer& L = *layers_[l];
      Tensor xa;
      auto lin = [&](int p, const Tensor& x, Tensor& y) {
        linear_forward(RIG_LIN(L.proj[p]), L.proj[p].lora_scale, 0.0f, 0, x, y, &xa);
      };
      ops::rmsnorm_forward(h, params_[size_t(L.in_norm)].value, eps, xn, rs);
      // Projections run where the model is; the cache and this single-row attention on the host.
      Tensor qd = fresh_on(dev_, {1, cfg_.q_dim()}, "q"),
             kd = fresh_on(dev_, {1, cfg_.kv_dim()}, "k"),
             vd = fresh_on(dev_, {1, cfg_.kv_dim()}, "v");
      lin(Q, xn, qd);
      lin(K, xn, kd);
      lin(V, xn, vd);
      ops::rope_forward(qd, posv, rope_cos_, rope_sin_, int(Hq));
      ops::rope_forward(kd, posv, rope_cos_, rope_sin_, int(Hk));
      cache.k[l].slice_rows(pos, pos + 1).copy_from(kd);
      cache.v[l].slice_rows(pos, pos + 1).copy_from(vd);
      Tensor q = qd.to(Device::cpu(), "q");
      Tensor att = Tensor::zeros({1, cfg_.q_dim()}, DType::F32, Device::cpu(), "attention");
      const float sc = 1.0f / std::sqrt(float(D));
      std::vector<float> s(size_t(pos + 1));
      for (int64_t hh = 0; hh < Hq; ++hh) {
        const float* qh = q.f32() + hh * D;
        const int64_t kh = hh / group;
        float mx = -1e30f;
        for (int64_t j = 0; j <= pos; ++j) {
          const float* kj = cache.k[l].f32() + j * cfg_.kv_dim() + kh * D;
          float dot = 0;
          for (int64_t x = 0; x < D; ++x) dot += qh[x] * kj[x];
          s[size_t(j)] = dot * sc;
          mx = std::max(mx, s[size_t(j)]);
        }
        double sum = 0;
        for (int64_t j = 0; j <= pos; ++j) sum += std::exp(double(s[size_t(j)] - mx));
        float* oh = att.f32() + hh * D;
        for (int64_t j = 0; j <= pos; ++j) {
          float p = float(std::exp(double(s[size_t(j)] - mx)) / sum);
          const float* vj = cache.v[l].f32() + j * cfg_.kv_dim() + kh * D;
          for (int64_t x = 0; x < D; ++x) oh[x] += p * vj[x];
        }
      }
      Tensor o = fresh_on(dev_, {1, H}, "o");
      lin(O, to_act(att.to(dev_, "attention")), o);
      ops::add_(h, o);
      ops::rmsnorm_forward(h, params_[size_t(L.post_norm)].value, eps, xn, rs);
      Tensor g = fresh_on(dev_, {1, F}, "g"), u = fresh_on(dev_, {1, F}, "u"),
             sw = fresh_on(dev_, {1, F}, "swiglu");
      lin(GATE, xn, g);
      lin(UP, xn, u);
      ops::swiglu_forward(g, u, sw);
      lin(DOWN, to_act(sw), o);
      ops::add_(h, o);
    }
    ++cache.len;
    ops::rmsnorm_forward(h, final_norm_, eps, xn, rs);
    Tensor lg = fresh_on(dev_, {1, cfg_.vocab_size}, "logits");
    ops::gemm(xn, false, lm_head_, true, lg, 1.0f, 0.0f);
    Tensor::view(logits.data(), {1, cfg_.vocab_size}, DType::F32, Device::cpu(), nullptr)
        .copy_from(lg);
  }
  return logits;
}

}  // namespace rig
