// Generation: the logits of the last token with a key/value cache. Everything runs where the
// model is, through the same ops as the training forward; the cache lives there too, in the
// compute dtype, with the positions, the last row's logits and the greedy pick. Only the last
// row's logits come back to the host (decode), or only the picked id (decode_greedy).
#include <algorithm>
#include <vector>

#include "rig/model/llama_parts.h"

namespace rig {

using namespace llama_detail;

LlamaModel::KVCache LlamaModel::new_cache(int64_t max_len) const {
  RIG_CHECK(max_len > 0, "a KV cache needs at least one row, got {}", max_len);
  KVCache c;
  // Rows from cache.len on are never read, so the cache needs no zeroing.
  for (size_t l = 0; l < layers_.size(); ++l) {
    c.k.push_back(act({max_len, cfg_.kv_dim()}, "kv cache"));
    c.v.push_back(act({max_len, cfg_.kv_dim()}, "kv cache"));
  }
  Tensor pos = Tensor::empty({max_len}, DType::I64, Device::cpu(), "positions");
  for (int64_t r = 0; r < max_len; ++r) pos.data<int64_t>()[r] = r;
  c.positions = pos.to(dev_, "positions");
  c.logits = fresh_on(dev_, {1, cfg_.vocab_size}, "logits");
  c.next = Tensor::zeros({1}, DType::I64, dev_, "next token");
  return c;
}

void LlamaModel::decode_rows(KVCache& cache, const Tensor& ids) {
  auto grad_of = [](int) -> Tensor* { return nullptr; };
  if (act_ != DType::F32 && !dev_.is_cuda())
    bad_input("bf16 compute needs a CUDA device; the CPU backend computes in float32");
  RIG_CHECK(cache.k.size() == layers_.size() && cache.v.size() == layers_.size(),
            "KV cache has {} layers, the model {}", cache.k.size(), layers_.size());
  RIG_CHECK(cache.k[0].device() == dev_ && cache.k[0].dtype() == act_,
            "KV cache is {} on {}, the model computes in {} on {}: make it with new_cache after "
            "to_device and set_compute_dtype",
            dtype_name(cache.k[0].dtype()), cache.k[0].device().str(), dtype_name(act_),
            dev_.str());
  const int64_t n = ids.numel(), past = cache.len, max_len = cache.k[0].dim(0);
  RIG_CHECK(n > 0, "decode needs at least one token");
  RIG_CHECK(cache.positions.defined() && cache.positions.numel() == max_len &&
                cache.logits.defined() && cache.next.defined(),
            "KV cache without its decode scratch: make it with new_cache");
  RIG_CHECK(past + n <= max_len, "KV cache full: {} tokens after {} in a cache of {}", n, past,
            max_len);
  if (cfg_.sliding_window && past + n > *cfg_.sliding_window)
    bad_input("{} tokens exceed the model's sliding window {}, which rig does not support yet",
              past + n, *cfg_.sliding_window);
  const int64_t H = cfg_.hidden_size, F = cfg_.intermediate_size, D = cfg_.head_dim;
  const int64_t Hq = cfg_.num_heads, Hk = cfg_.num_kv_heads;
  const float eps = float(cfg_.rms_norm_eps);
  bind_outer();
  ensure_rope(max_len);  // once per cache: the table covers every row it can hold
  const Tensor pos = cache.positions.slice_rows(past, past + n);
  // The residual stream is float32, as in the training forward; the products read act_. The
  // scratch is made once per step and reused by every layer.
  Tensor h = fresh_on(dev_, {n, H}, "decode"), xn = act({n, H}, "decode"),
         rs = fresh_on(dev_, {n}, "decode");
  Tensor q = act({n, cfg_.q_dim()}, "q"), att = act({n, cfg_.q_dim()}, "attention out");
  Tensor g = act({n, F}, "gate"), u = act({n, F}, "up"), sw = act({n, F}, "swiglu");
  Tensor qr, kr, rq, rk;  // qwen3: the projections before their head norms, and the norms' rstd
  if (cfg_.qk_norm) {
    qr = act({n, cfg_.q_dim()}, "q");
    kr = act({n, cfg_.kv_dim()}, "k");
    rq = fresh_on(dev_, {n * Hq}, "rstd");
    rk = fresh_on(dev_, {n * Hk}, "rstd");
  }
  const Tensor att3 = att.reshape({n, Hq, D}), q3 = q.reshape({n, Hq, D});
  ops::embedding_forward(ids, embed_, h);
  for (size_t l = 0; l < layers_.size(); ++l) {
    Layer& L = *layers_[l];
    Tensor xa;
    auto lin = [&](int p, const Tensor& x, Tensor& y, const Tensor* residual = nullptr) {
      linear_forward(RIG_LIN(L.proj[p]), L.proj[p].lora_scale, 0.0f, 0, x, y, &xa, residual);
    };
    ops::rmsnorm_forward(h, params_[size_t(L.in_norm)].value, eps, xn, rs);
    // k and v are written straight into their cache rows (contiguous views), rope'd in place.
    Tensor kc = cache.k[l].slice_rows(past, past + n), vc = cache.v[l].slice_rows(past, past + n);
    if (L.q_norm >= 0) {
      // qwen3: the projections go through their head norms on the way to q and the cache.
      lin(Q, xn, qr);
      lin(K, xn, kr);
      auto head_norm = [&](const Tensor& raw, Tensor& out, Tensor& r, int norm) {
        const int64_t rows = raw.numel() / D;
        Tensor y = out.reshape({rows, D});
        ops::rmsnorm_forward(raw.reshape({rows, D}), params_[size_t(norm)].value, eps, y, r);
      };
      head_norm(qr, q, rq, L.q_norm);
      head_norm(kr, kc, rk, L.k_norm);
    } else {
      lin(Q, xn, q);
      lin(K, xn, kc);
    }
    lin(V, xn, vc);
    ops::rope_forward(q, pos, rope_cos_, rope_sin_, int(Hq));
    ops::rope_forward(kc, pos, rope_cos_, rope_sin_, int(Hk));
    Tensor out3 = att3;
    ops::attention_decode(q3, cache.k[l].reshape({max_len, Hk, D}),
                          cache.v[l].reshape({max_len, Hk, D}), past, out3);
    lin(O, att, h, &h);  // h += att @ Wo^T, the add riding the product as in the forward
    ops::rmsnorm_forward(h, params_[size_t(L.post_norm)].value, eps, xn, rs);
    lin(GATE, xn, g);
    lin(UP, xn, u);
    ops::swiglu_forward(g, u, sw);
    lin(DOWN, sw, h, &h);
  }
  cache.len += n;
  // Only the last row needs the LM head.
  Tensor hl = h.slice_rows(n - 1, n), xl = xn.slice_rows(n - 1, n), rl = rs.slice_rows(n - 1, n);
  ops::rmsnorm_forward(hl, final_norm_, eps, xl, rl);
  ops::gemm(xl, false, lm_head_, true, cache.logits, 1.0f, 0.0f);
}

namespace {

// Host token ids checked against the vocabulary and copied to `dev` (one copy for the prompt).
Tensor ids_on(Device dev, const std::vector<int64_t>& tokens, int64_t vocab) {
  RIG_CHECK(!tokens.empty(), "decode needs at least one token");
  const int64_t n = int64_t(tokens.size());
  check_vocab(tokens.data(), n, n, vocab, "token id", false);
  Tensor ids = Tensor::empty({n}, DType::I64, Device::cpu(), "token ids");
  std::copy(tokens.begin(), tokens.end(), ids.data<int64_t>());
  return dev.is_cpu() ? ids : ids.to(dev, "token ids");
}

}  // namespace

std::vector<float> LlamaModel::decode(KVCache& cache, const std::vector<int64_t>& tokens) {
  decode_rows(cache, ids_on(dev_, tokens, cfg_.vocab_size));
  std::vector<float> logits(size_t(cfg_.vocab_size));
  Tensor::view(logits.data(), {1, cfg_.vocab_size}, DType::F32, Device::cpu(), nullptr)
      .copy_from(cache.logits);
  return logits;
}

int64_t LlamaModel::decode_greedy(KVCache& cache, const std::vector<int64_t>& tokens,
                                  int64_t limit) {
  if (tokens.empty()) {
    RIG_CHECK(cache.len > 0 && cache.next.defined(),
              "decode_greedy without tokens feeds the previous pick: there is none yet");
    decode_rows(cache, cache.next);  // read by the embedding before the pick below rewrites it
  } else {
    decode_rows(cache, ids_on(dev_, tokens, cfg_.vocab_size));
  }
  const int64_t V = cfg_.vocab_size;
  ops::argmax(cache.logits, limit > 0 ? std::min(limit, V) : V, cache.next);
  int64_t id = 0;
  Tensor::view(&id, {1}, DType::I64, Device::cpu(), nullptr).copy_from(cache.next);
  return id;
}

}  // namespace rig
