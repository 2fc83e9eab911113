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

struct AdamW::Pieced {
  int64_t numel = 0;  // the shard's
  std::vector<Piece> pieces;
  std::vector<int64_t> at;  // offset of each piece in its kind's packed state
  int64_t n8 = 0, n32 = 0;  // packed lengths (8-bit: whole blocks per piece)
  bool allocated = false;
  Moments8 q;
  Tensor m, v;
};

namespace {
int64_t blocks_of(int64_t n) {
  return (n + ops::kAdam8Block - 1) / ops::kAdam8Block;
}
}  // namespace

void AdamW::set_pieces(const std::string& param, int64_t numel, std::vector<Piece> pieces) {
  auto s = std::make_shared<Pieced>();
  s->numel = numel;
  for (const Piece& pc : pieces) {
    RIG_CHECK(pc.begin >= 0 && pc.begin <= pc.end && pc.end <= numel &&
                  pc.end - pc.begin <= pc.tensor_numel,
              "adamw: piece [{}, {}) of '{}' ({} elements)", pc.begin, pc.end, param, numel);
    if (eight_bit(pc.tensor_numel)) {
      // Block boundaries must be the unsharded tensor's: the sharder aligns them.
      RIG_CHECK(pc.begin % ops::kAdam8Block == 0,
                "adamw: 8-bit piece of '{}' starts at {}, not on a block", param, pc.begin);
      s->at.push_back(s->n8);
      s->n8 += blocks_of(pc.end - pc.begin) * ops::kAdam8Block;
    } else {
      s->at.push_back(s->n32);
      s->n32 += pc.end - pc.begin;
    }
  }
  s->pieces = std::move(pieces);
  pieced_[param] = std::move(s);
}

void AdamW::step_pieced(Param& p, Pieced& s, const ops::AdamWParams& hp, float wd, float coef,
                        std::vector<ops::AdamWSlot>& slots) {
  RIG_CHECK(p.value.numel() == s.numel, "adamw: '{}' has {} elements, its pieces cover {}", p.name,
            p.value.numel(), s.numel);
  const Device d = p.value.device();
  if (!s.allocated) {
    s.q = Moments8{Tensor::zeros({s.n8}, DType::U8, d, "adamw8bit m"),
                   Tensor::zeros({s.n8 / ops::kAdam8Block}, DType::F32, d, "adamw8bit m absmax"),
                   Tensor::zeros({s.n8}, DType::U8, d, "adamw8bit v"),
                   Tensor::zeros({s.n8 / ops::kAdam8Block}, DType::F32, d, "adamw8bit v absmax")};
    s.m = Tensor::zeros({s.n32}, DType::F32, d, "adamw m");
    s.v = Tensor::zeros({s.n32}, DType::F32, d, "adamw v");
    s.allocated = true;
  }
  for (size_t i = 0; i < s.pieces.size(); ++i) {
    const Piece& pc = s.pieces[i];
    const int64_t len = pc.end - pc.begin, at = s.at[i];
    if (len == 0) continue;
    Tensor value = p.value.slice_rows(pc.begin, pc.end), grad = p.grad.slice_rows(pc.begin, pc.end);
    Tensor copy = p.compute.defined() ? p.compute.slice_rows(pc.begin, pc.end) : Tensor();
    if (!eight_bit(pc.tensor_numel)) {
      slots.push_back(
          {value, grad, s.m.slice_rows(at, at + len), s.v.slice_rows(at, at + len), copy, wd});
      continue;
    }
    const int64_t b0 = at / ops::kAdam8Block, b1 = b0 + blocks_of(len);
    Tensor mq = s.q.mq.slice_rows(at, at + len), vq = s.q.vq.slice_rows(at, at + len),
           mabs = s.q.mabs.slice_rows(b0, b1), vabs = s.q.vabs.slice_rows(b0, b1);
    if (coef < 1.0f) ops::scale_(grad, coef);
    ops::AdamWParams h8 = hp;
    h8.weight_decay = wd;
    ops::adamw8bit_step(value, grad, mq, mabs, vq, vabs, h8);
    if (copy.defined()) ops::cast(value, copy);
  }
}

// From shard coordinates (as state_tensors() gives them) into the packed state; none of the keys:
// no state yet.
void AdamW::load_pieced(const std::string& name, Pieced& s,
                        const std::map<std::string, Tensor>& tensors, Device dev) {
  s.allocated = false;
  auto find = [&](const std::string& key, int64_t numel, DType dt) {
    auto it = tensors.find(key);
    if (it == tensors.end()) return Tensor();
    RIG_CHECK(it->second.numel() == numel && it->second.dtype() == dt,
              "optimizer state '{}' has {} elements of {}, expected {} of {}", key,
              it->second.numel(), dtype_name(it->second.dtype()), numel, dtype_name(dt));
    return it->second.reshape({numel});
  };
  Tensor m = find("adamw.m." + name, s.numel, DType::F32),
         v = find("adamw.v." + name, s.numel, DType::F32);
  Tensor mq = find("adamw8bit.mq." + name, s.numel, DType::U8),
         vq = find("adamw8bit.vq." + name, s.numel, DType::U8),
         mabs = find("adamw8bit.mabs." + name, blocks_of(s.numel), DType::F32),
         vabs = find("adamw8bit.vabs." + name, blocks_of(s.numel), DType::F32);
  const bool any32 = m.defined() || v.defined(),
             any8 = mq.defined() || vq.defined() || mabs.defined() || vabs.defined();
  if (!any32 && !any8) return;
  RIG_CHECK(s.n32 == 0 || (m.defined() && v.defined()),
            "optimizer state for '{}' lacks its float32 moments", name);
  RIG_CHECK(s.n8 == 0 || (mq.defined() && vq.defined() && mabs.defined() && vabs.defined()),
            "optimizer state for '{}' lacks its 8-bit moments", name);
  s.q = Moments8{Tensor::zeros({s.n8}, DType::U8, dev, "adamw8bit m"),
                 Tensor::zeros({s.n8 / ops::kAdam8Block}, DType::F32, dev, "adamw8bit m absmax"),
                 Tensor::zeros({s.n8}, DType::U8, dev, "adamw8bit v"),
                 Tensor::zeros({s.n8 / ops::kAdam8Block}, DType::F32, dev, "adamw8bit v absmax")};
  s.m = Tensor::zeros({s.n32}, DType::F32, dev, "adamw m");
  s.v = Tensor::zeros({s.n32}, DType::F32, dev, "adamw v");
  for (size_t i = 0; i < s.pieces.size(); ++i) {
    const Piece& pc = s.pieces[i];
    const int64_t len = pc.end - pc.begin, at = s.at[i];
    if (len == 0) continue;
    if (!eight_bit(pc.tensor_numel)) {
      s.m.slice_rows(at, at + len).copy_from(m.slice_rows(pc.begin, pc.end));
      s.v.slice_rows(at, at + len).copy_from(v.slice_rows(pc.begin, pc.end));
      continue;
    }
    s.q.mq.slice_rows(at, at + len).copy_from(mq.slice_rows(pc.begin, pc.end));
    s.q.vq.slice_rows(at, at + len).copy_from(vq.slice_rows(pc.begin, pc.end));
    const int64_t nb = blocks_of(len), sb = pc.begin / ops::kAdam8Block, ab = at / ops::kAdam8Block;
    s.q.mabs.slice_rows(ab, ab + nb).copy_from(mabs.slice_rows(sb, sb + nb));
    s.q.vabs.slice_rows(ab, ab + nb).copy_from(vabs.slice_rows(sb, sb + nb));
  }
  s.allocated = true;
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
    if (auto pc = pieced_.find(p.name); pc != pieced_.end()) {
      step_pieced(p, *pc->second, hp, wd, coef, slots);
      continue;
    }
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
  // Pieced: unpacked into the shard's coordinates.
  for (const auto& [name, s] : pieced_) {
    if (!s->allocated) continue;
    const Device d = s->m.device();
    Tensor mq, mabs, vq, vabs, m, v;
    if (s->n8 > 0) {
      mq = Tensor::zeros({s->numel}, DType::U8, d, "adamw8bit m");
      vq = Tensor::zeros({s->numel}, DType::U8, d, "adamw8bit v");
      mabs = Tensor::zeros({blocks_of(s->numel)}, DType::F32, d, "adamw8bit m absmax");
      vabs = Tensor::zeros({blocks_of(s->numel)}, DType::F32, d, "adamw8bit v absmax");
    }
    if (s->n32 > 0) {
      m = Tensor::zeros({s->numel}, DType::F32, d, "adamw m");
      v = Tensor::zeros({s->numel}, DType::F32, d, "adamw v");
    }
    for (size_t i = 0; i < s->pieces.size(); ++i) {
      const Piece& pc = s->pieces[i];
      const int64_t len = pc.end - pc.begin, at = s->at[i];
      if (len == 0) continue;
      if (!eight_bit(pc.tensor_numel)) {
        m.slice_rows(pc.begin, pc.end).copy_from(s->m.slice_rows(at, at + len));
        v.slice_rows(pc.begin, pc.end).copy_from(s->v.slice_rows(at, at + len));
        continue;
      }
      mq.slice_rows(pc.begin, pc.end).copy_from(s->q.mq.slice_rows(at, at + len));
      vq.slice_rows(pc.begin, pc.end).copy_from(s->q.vq.slice_rows(at, at + len));
      const int64_t nb = blocks_of(len), sb = pc.begin / ops::kAdam8Block,
                    ab = at / ops::kAdam8Block;
      mabs.slice_rows(sb, sb + nb).copy_from(s->q.mabs.slice_rows(ab, ab + nb));
      vabs.slice_rows(sb, sb + nb).copy_from(s->q.vabs.slice_rows(ab, ab + nb));
    }
    if (s->n32 > 0) {
      out.emplace_back("adamw.m." + name, m);
      out.emplace_back("adamw.v." + name, v);
    }
    if (s->n8 > 0) {
      out.emplace_back("adamw8bit.mq." + name, mq);
      out.emplace_back("adamw8bit.mabs." + name, mabs);
      out.emplace_back("adamw8bit.vq." + name, vq);
      out.emplace_back("adamw8bit.vabs." + name, vabs);
    }
  }
  return out;
}

size_t AdamW::state_bytes() const {
  size_t n = 0;
  for (const auto& [name, mv] : mv_) n += mv.first.nbytes() + mv.second.nbytes();
  for (const auto& [name, s] : mv8_)
    n += s.mq.nbytes() + s.mabs.nbytes() + s.vq.nbytes() + s.vabs.nbytes();
  for (const auto& [name, s] : pieced_)
    if (s->allocated)
      n += s->m.nbytes() + s->v.nbytes() + s->q.mq.nbytes() + s->q.mabs.nbytes() +
           s->q.vq.nbytes() + s->q.vabs.nbytes();
  return n;
}

void AdamW::load_state(const std::map<std::string, Tensor>& tensors, int64_t step, Device dev) {
  mv_.clear();
  mv8_.clear();
  step_ = step;
  for (auto& [name, s] : pieced_) load_pieced(name, *s, tensors, dev);
  for (const auto& [key, t] : tensors) {
    if (key.rfind("adamw8bit.mq.", 0) != 0) continue;
    const std::string name = key.substr(13);
    if (pieced_.count(name)) continue;
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
    if (pieced_.count(name)) continue;
    auto v = tensors.find("adamw.v." + name);
    RIG_CHECK(v != tensors.end(), "optimizer state for '{}' has m but no v", name);
    mv_.emplace(name, std::make_pair(t.to(dev, "adamw m"), v->second.to(dev, "adamw v")));
  }
}

}  // namespace rig
