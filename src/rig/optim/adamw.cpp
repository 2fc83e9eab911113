#include "rig/optim/adamw.h"

#include <algorithm>
#include <cmath>

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
  if (cfg_.max_grad_norm > 0) {
    float coef = float(cfg_.max_grad_norm / (float(norm) + 1e-6f));
    if (coef < 1.0f)
      for (auto& p : params)
        if (p.trainable && p.grad.defined()) ops::scale_(p.grad, coef);
  }
  ++step_;
  for (auto& p : params) {
    if (!p.trainable || !p.grad.defined()) continue;
    auto it = mv_.find(p.name);
    if (it == mv_.end()) {
      it = mv_.emplace(p.name, std::make_pair(Tensor::zeros(p.value.shape(), DType::F32, p.value.device(), "adamw m"),
                                              Tensor::zeros(p.value.shape(), DType::F32, p.value.device(), "adamw v")))
               .first;
    }
    const float wd = cfg_.no_decay_on_norms_and_biases && p.no_decay ? 0.0f : cfg_.weight_decay;
    ops::adamw_step(p.value, p.grad, it->second.first, it->second.second,
                    ops::AdamWParams{lr, cfg_.beta1, cfg_.beta2, cfg_.eps, wd, step_});
  }
  return norm;
}

std::vector<std::pair<std::string, Tensor>> AdamW::state_tensors() const {
  std::vector<std::pair<std::string, Tensor>> out;
  for (const auto& [name, mv] : mv_) {
    out.emplace_back("adamw.m." + name, mv.first);
    out.emplace_back("adamw.v." + name, mv.second);
  }
  return out;
}

void AdamW::load_state(const std::map<std::string, Tensor>& tensors, int64_t step, Device dev) {
  mv_.clear();
  step_ = step;
  for (const auto& [key, t] : tensors) {
    if (key.rfind("adamw.m.", 0) != 0) continue;
    std::string name = key.substr(8);
    auto v = tensors.find("adamw.v." + name);
    RIG_CHECK(v != tensors.end(), "optimizer state for '{}' has m but no v", name);
    mv_.emplace(name, std::make_pair(t.to(dev, "adamw m"), v->second.to(dev, "adamw v")));
  }
}

}  // namespace rig
