// What the LlamaModel source files share and nothing else includes: the layer structures, the
// scratch helpers, and one linear layer's forward and backward with LoRA. llama.cpp holds the
// parameters, loading, saving, LoRA and quantization; llama_step.cpp the training step;
// llama_decode.cpp generation with a KV cache.
#pragma once
#include <cstdint>
#include <string>

#include "rig/model/llama.h"
#include "rig/ops/ops.h"

namespace rig {

struct LlamaModel::Linear {
  std::string module;  // Hugging Face module name, e.g. model.layers.0.self_attn.q_proj
  int w = -1, b = -1, lora_a = -1, lora_b = -1;  // indices into params_
  float lora_scale = 0, lora_dropout = 0;
};

struct LlamaModel::Layer {
  int in_norm = -1, post_norm = -1;
  int q_norm = -1, k_norm = -1;  // qwen3's per-head norms of q and k (-1: none)
  Linear proj[7];  // q k v o gate up down
};

// What one layer's backward needs from its forward.
struct LlamaModel::Acts {
  Tensor h_in, xn1, rstd1, q, k, v, attn, lse, h_mid, xn2, rstd2, g, u, act, h_out;
  Tensor q_raw, k_raw, rstd_q, rstd_k;  // qk_norm: the projections before their norms
  Tensor xa[7];  // LoRA: dropout(x) @ A^T per projection
  void drop_all_but_input() {
    Tensor keep = h_in;
    *this = Acts();
    h_in = keep;
  }
};

namespace llama_detail {

enum { Q, K, V, O, GATE, UP, DOWN };

inline Tensor fresh_on(Device d, const Shape& s, const char* what) {
  return Tensor::empty(s, DType::F32, d, what);
}
inline Tensor fresh(const Shape& s, const char* what) {
  return fresh_on(Device::cpu(), s, what);
}
// Scratch on the device and in the dtype of `like`.
inline Tensor fresh_like(const Tensor& like, const Shape& s, const char* what) {
  return Tensor::empty(s, like.dtype(), like.device(), what);
}

inline uint64_t mix_seed(uint64_t seed, int layer, int proj) {
  uint64_t x =
      seed * 0x9E3779B97F4A7C15ull + uint64_t(layer) * 0xBF58476D1CE4E5B9ull + uint64_t(proj + 1);
  x ^= x >> 31;
  return x * 0x94D049BB133111EBull;
}

struct LinearRefs {
  const Tensor &w, &b, &a, &bl;
  Tensor *dw, *db, *da, *dbl;
};

// y = x @ W^T (+ bias) (+ LoRA); with `residual`, y = residual + that, the add riding the product.
void linear_forward(const LinearRefs& L, float scale, float p, uint64_t seed, const Tensor& x,
                    Tensor& y, Tensor* xa, const Tensor* residual = nullptr);
// dx = dy @ W (+ dx when accumulate); parameter gradients accumulate where defined.
void linear_backward(const LinearRefs& L, float scale, float p, uint64_t seed, const Tensor& x,
                     const Tensor& dy, const Tensor& xa, Tensor& dx, bool accumulate);

inline const Tensor kNone;

// Fails naming the first value of v [n] outside [0, vocab) by its row and position (rows of
// row_len); -100 passes when ignore_allowed (labels). A host check, because the GPU kernels
// report bad ids only at the next synchronising op.
void check_vocab(const int64_t* v, int64_t n, int64_t row_len, int64_t vocab, const char* what,
                 bool ignore_allowed);

}  // namespace llama_detail

// The LinearRefs of a Linear inside a LlamaModel member that defines grad_of(int) -> Tensor*.
#define RIG_LIN(lin)                                                                           \
  LinearRefs {                                                                                 \
    weight_operand((lin).w), (lin).b >= 0 ? params_[size_t((lin).b)].operand() : kNone,        \
        (lin).lora_a >= 0 ? params_[size_t((lin).lora_a)].operand() : kNone,                   \
        (lin).lora_b >= 0 ? params_[size_t((lin).lora_b)].operand() : kNone, grad_of((lin).w), \
        grad_of((lin).b), grad_of((lin).lora_a), grad_of((lin).lora_b)                         \
  }

}  // namespace rig
