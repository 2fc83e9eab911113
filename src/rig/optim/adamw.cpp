#include "rig/optim/adamw.h"

#include <algorithm>
#include <cmath>

#include "rig/ops/adamw8bit.h"
#include "rig/ops/ops.h"

namespace rig {

double grad_norm(const std::vector<Param>& params) {
  // torch: the norm of the per-tensor norms, each in float32.
  std::vector<Tensor> grads;
  for (const auto& p : params)
    if (p.trainable && p.grad.defined()) grads.push_back(p.grad);
  double total = 0;
  for (double s : ops::sum_squares_list(grads)) {
    const float n = float(std::sqrt(s));
    total += double(n) * n;
  }
  return std::sqrt(total);
}

double AdamW::clip_and_step(std::vector<Param>& params, float lr) {
  return clip_and_step(params, lr, grad_norm(params));
}

double AdamW::clip_and_step(std::vector<Param>& params, float lr, double norm) {
  float coef = 1.0f;  // as clip_grad_norm_: gradients scaled only when the norm is above the limit
  if (cfg_.max_grad_norm > 0)
    coef = std::min(1.0f, float(cfg_.max_grad_norm / (float(norm) + 1e-6f)));
  ++step_;
  const ops::AdamWParams hp{lr, cfg_.beta1, cfg_.beta2, cfg_.eps, cfg_.weight_decay, step_};
  // Float32 moments: one pass over all of them that also applies the clip and writes the compute
  // copies. 8-bit moments: one kernel per tensor.
  std::vector<ops::AdamWSlot> slots;
  for (auto& p : params) {
    if (!p.trainable || !p.grad.defined()) continue;
    const float wd = cfg_.no_decay_on_norms_and_biases && p.no_decay ? 0.0f : cfg_.weight_decay;
    if (cfg_.eight_bit && p.value.numel() >= cfg_.min_8bit_size) {
      auto q = mv8_.find(p.name);
      if (q == mv8_.end()) {
        const int64_t n = p.value.numel(), blocks = (n + ops::kAdam8Block - 1) / ops::kAdam8Block;
        const Device d = p.value.device();
        q = mv8_.emplace(p.name,
                         Moments8{Tensor::zeros({n}, DType::U8, d, "adamw8bit m"),
                                  Tensor::zeros({blocks}, DType::F32, d, "adamw8bit m absmax"),
                                  Tensor::zeros({n}, DType::U8, d, "adamw8bit v"),
                                  Tensor::zeros({blocks}, DType::F32, d, "adamw8bit v absmax")})
                .first;
      }
      if (coef < 1.0f) ops::scale_(p.grad, coef);
      Moments8& s = q->second;
      ops::AdamWParams h8 = hp;
      h8.weight_decay = wd;
      ops::adamw8bit_step(p.value, p.grad, s.mq, s.mabs, s.vq, s.vabs, h8);
      if (p.compute.defined()) ops::cast(p.value, p.compute);
      continue;
    }
    auto it = mv_.find(p.name);
    if (it == mv_.end()) {
      it = mv_.emplace(p.name, std::make_pair(Tensor::zeros(p.value.shape(), DType::F32, p.value.device(), "adamw m"),
                                              Tensor::zeros(p.value.shape(), DType::F32, p.value.device(), "adamw v")))
               .first;
    }
    slots.push_back({p.value, p.grad, it->second.first, it->second.second, p.compute, wd});
  }
  ops::adamw_step_list(slots, hp, coef);
  return norm;
}

std::vector<std::pair<std::string, Tensor>> AdamW::state_tensors() const {
  std::vector<std::pair<std::string, Tensor>> out;
  for (const auto& [name, mv] : mv_) {
    out.emplace_back("adamw.m." + name, mv.first);
    out.emplace_back("adamw.v." + name, mv.second);
  }
  for (const auto& [name, s] : mv8_) {
    out.emplace_back("adamw8bit.mq." + name, s.mq);
    out.emplace_back("adamw8bit.mabs." + name, s.mabs);
    out.emplace_back("adamw8bit.vq." + name, s.vq);
    out.emplace_back("adamw8bit.vabs." + name, s.vabs);
  }
  return out;
}

size_t AdamW::state_bytes() const {
  size_t n = 0;
  for (const auto& [name, t] : state_tensors()) n += t.nbytes();
  return n;
}

void AdamW::load_state(const std::map<std::string, Tensor>& tensors, int64_t step, Device dev) {
  mv_.clear();
  mv8_.clear();
  step_ = step;
  for (const auto& [key, t] : tensors) {
    if (key.rfind("adamw8bit.mq.", 0) != 0) continue;
    const std::string name = key.substr(13);
    auto part = [&](const char* what) {
      auto it = tensors.find(std::string("adamw8bit.") + what + "." + name);
      RIG_CHECK(it != tensors.end(), "8-bit optimizer state for '{}' has no {}", name, what);
      return it->second.to(dev, "adamw8bit state");
    };
    mv8_.emplace(name, Moments8{t.to(dev, "adamw8bit m"), part("mabs"), part("vq"), part("vabs")});
  }
  for (const auto& [key, t] : tensors) {
    if (key.rfind("adamw.m.", 0) != 0) continue;
    std::string name = key.substr(8);
    auto v = tensors.find("adamw.v." + name);
    RIG_CHECK(v != tensors.end(), "optimizer state for '{}' has m but no v", name);
    mv_.emplace(name, std::make_pair(t.to(dev, "adamw m"), v->second.to(dev, "adamw v")));
  }
}

}  // namespace rig
