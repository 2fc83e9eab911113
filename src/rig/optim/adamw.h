// AdamW exactly as torch.optim.AdamW (decoupled weight decay, bias correction), with global
// gradient-norm clipping as torch.nn.utils.clip_grad_norm_, and learning-rate schedules.
#pragma once
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "rig/model/llama.h"
#include "rig/ops/ops.h"

namespace rig {

struct OptimizerConfig {
  float lr = 2e-4f, beta1 = 0.9f, beta2 = 0.999f, eps = 1e-8f, weight_decay = 0.0f;
  float max_grad_norm = 1.0f;  // 0: no clipping
  bool no_decay_on_norms_and_biases = false;
  // 8-bit moments (ops/adamw8bit.h) for tensors of at least min_8bit_size elements; smaller ones
  // (norms, biases) keep float32 moments, as bitsandbytes does.
  bool eight_bit = false;
  int64_t min_8bit_size = 4096;
};

class AdamW {
 public:
  explicit AdamW(OptimizerConfig c) : cfg_(c) {}
  // Clips the global gradient norm, then updates every trainable parameter and its compute copy
  // (Param::compute, where the model keeps one). Returns the norm before clipping. The clip is
  // applied as the update reads each gradient: float32-moment gradients are left unscaled.
  double clip_and_step(std::vector<Param>& params, float lr);
  // The same with the norm already known (the guard reads it before deciding to step).
  double clip_and_step(std::vector<Param>& params, float lr, double norm);
  int64_t steps() const { return step_; }

  // Optimizer state for checkpoints: "adamw.m.<param>", "adamw.v.<param>" (float32 moments) or
  // "adamw8bit.{mq,mabs,vq,vabs}.<param>" (8-bit moments: codes and block absmax).
  std::vector<std::pair<std::string, Tensor>> state_tensors() const;
  // Bytes of optimizer state held now.
  size_t state_bytes() const;
  void load_state(const std::map<std::string, Tensor>& tensors, int64_t step, Device dev);

  // A parameter that is a flat shard of several tensors (strategy: sharded): [begin, end) of it
  // is part of a tensor of tensor_numel elements and starts on one of that tensor's 256-blocks.
  // Each piece gets the moments its whole tensor gets unsharded (8-bit from min_8bit_size on), so
  // a shard steps bit for bit as the same elements do in one rank's step. Its state is packed
  // (each kind only where used); state_tensors() gives it in the shard's coordinates:
  // "adamw8bit.{mq,mabs,vq,vabs}.<param>" (absmax per 256 of the shard) and "adamw.{m,v}.<param>"
  // for the float32 pieces, zero elsewhere; load_state takes the same.
  struct Piece {
    int64_t begin = 0, end = 0, tensor_numel = 0;
  };
  void set_pieces(const std::string& param, int64_t numel, std::vector<Piece> pieces);
  const OptimizerConfig& config() const { return cfg_; }
  bool eight_bit(int64_t tensor_numel) const {
    return cfg_.eight_bit && tensor_numel >= cfg_.min_8bit_size;
  }

 private:
  struct Moments8 {
    Tensor mq, mabs, vq, vabs;
  };
  struct Pieced;
  void step_pieced(Param& p, Pieced& s, const ops::AdamWParams& hp, float wd, float coef,
                   std::vector<ops::AdamWSlot>& slots);
  void load_pieced(const std::string& name, Pieced& s, const std::map<std::string, Tensor>& tensors,
                   Device dev);
  OptimizerConfig cfg_;
  int64_t step_ = 0;
  std::map<std::string, std::pair<Tensor, Tensor>> mv_;
  std::map<std::string, Moments8> mv8_;
  std::map<std::string, std::shared_ptr<Pieced>> pieced_;
};

// Global L2 norm of the gradients of trainable parameters.
double grad_norm(const std::vector<Param>& params);

}  // namespace rig
