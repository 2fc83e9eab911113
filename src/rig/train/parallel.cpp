#include "rig/train/parallel.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <optional>
#include <random>

#include "rig/io/atomic_file.h"
#include "rig/io/safetensors.h"
#include "rig/ops/adamw8bit.h"
#include "rig/ops/ops.h"
#include "rig/train/checkpoint.h"

namespace rig {

namespace fs = std::filesystem;
using json = nlohmann::json;

// ---- data parallel --------------------------------------------------------------------------

// One weight matrix's gradient under PowerSGD: the warm-started Q and the error feedback.
struct DataParallel::Compressed {
  Tensor grad, q, error;  // grad [n, m], q [m, r], error [n, m]
  Tensor q0;              // the seeded start of q
};

DataParallel::DataParallel(dist::Communicator& comm, LlamaModel& model, size_t bucket_bytes,
                           int powersgd_rank, uint64_t seed)
    : comm_(comm), rank_(powersgd_rank) {
  model.zero_grad();
  const std::vector<int> groups = model.param_groups();
  int layers = 0;
  for (int g : groups) layers = std::max(layers, g + 1);
  // Bucket order = the order gradients become final: last layer first, the outer ones last.
  std::vector<int> order;
  for (int l = layers - 1; l >= 0; --l) order.push_back(l);
  order.push_back(-1);
  std::vector<Tensor> tensors;
  auto& ps = model.params();
  std::mt19937_64 rng(seed ^ 0x9051ull);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (int g : order)
    for (size_t i = 0; i < ps.size(); ++i) {
      if (groups[i] != g || !ps[i].trainable || !ps[i].grad.defined()) continue;
      const Tensor& gr = ps[i].grad;
      // Worth compressing: (n + m) r numbers instead of n m.
      if (rank_ > 0 && gr.ndim() == 2 && (gr.dim(0) + gr.dim(1)) * rank_ < gr.dim(0) * gr.dim(1)) {
        Compressed c;
        c.grad = gr;
        // The same start on every rank (same seed, same order).
        Tensor q = Tensor::empty({gr.dim(1), rank_}, DType::F32, Device::cpu(), "powersgd q");
        for (int64_t k = 0; k < q.numel(); ++k) q.f32()[k] = normal(rng);
        c.q = q.to(gr.device(), "powersgd q");
        c.q0 = q.to(gr.device(), "powersgd q start");
        c.error = Tensor::zeros(gr.shape(), DType::F32, gr.device(), "powersgd error");
        compressed_.push_back(std::move(c));
        continue;
      }
      of_group_[g].push_back(tensors.size());
      tensors.push_back(gr);
    }
  if (!tensors.empty())
    buckets_ = std::make_unique<dist::BucketedAllReduce>(comm, std::move(tensors), bucket_bytes,
                                                         dist::ReduceOp::Sum);
}

DataParallel::~DataParallel() = default;

void DataParallel::reset_compression() {
  for (auto& c : compressed_) {
    c.error.zero_();
    c.q.copy_from(c.q0);
  }
}

void DataParallel::after(int group, Phase phase) {
  if (!sync_ || phase != Backward || !buckets_) return;
  auto it = of_group_.find(group);
  if (it == of_group_.end()) return;
  for (size_t i : it->second) buckets_->mark_ready(i);
}

void DataParallel::finish() {
  if (buckets_) buckets_->finish();
  if (!compressed_.empty()) powersgd();
}

namespace {

// Gram-Schmidt on the columns of p [n, r] (on the host; r is small).
void orthonormalize_columns(Tensor& p) {
  Tensor h = p.device().is_cpu() ? p : p.to(Device::cpu(), "powersgd p");
  const int64_t n = h.dim(0), r = h.dim(1);
  float* x = h.f32();
  for (int64_t j = 0; j < r; ++j) {
    for (int64_t k = 0; k < j; ++k) {
      double dot = 0;
      for (int64_t i = 0; i < n; ++i) dot += double(x[i * r + j]) * x[i * r + k];
      for (int64_t i = 0; i < n; ++i) x[i * r + j] -= float(dot) * x[i * r + k];
    }
    double norm = 0;
    for (int64_t i = 0; i < n; ++i) norm += double(x[i * r + j]) * x[i * r + j];
    const float inv = float(1.0 / (std::sqrt(norm) + 1e-8));
    for (int64_t i = 0; i < n; ++i) x[i * r + j] *= inv;
  }
  if (!p.device().is_cpu()) p.copy_from(h);
}

}  // namespace

// PowerSGD (one power iteration, warm-started): M = grad + error; P = sum over ranks of M Q;
// orthonormalise P; Q = sum over ranks of M^T P; grad = P Q^T; error = M - P (M^T P)^T with this
// rank's own M. Two all-reduces of (n + m) r numbers per matrix, batched over all matrices.
void DataParallel::powersgd() {
  int64_t np = 0, nq = 0;
  for (auto& c : compressed_) {
    np += c.grad.dim(0) * rank_;
    nq += c.grad.dim(1) * rank_;
  }
  const Device dev = compressed_[0].grad.device();
  Tensor pall = Tensor::empty({np}, DType::F32, dev, "powersgd p"),
         qall = Tensor::empty({nq}, DType::F32, dev, "powersgd q");
  std::vector<Tensor> ps, qs;
  int64_t op = 0, oq = 0;
  for (auto& c : compressed_) {
    const int64_t n = c.grad.dim(0), m = c.grad.dim(1);
    ops::add_(c.grad, c.error);  // M
    Tensor p = pall.slice_rows(op, op + n * rank_).reshape({n, rank_});
    ops::gemm(c.grad, false, c.q, false, p, 1.0f, 0.0f);
    ps.push_back(p);
    qs.push_back(qall.slice_rows(oq, oq + m * rank_).reshape({m, rank_}));
    op += n * rank_;
    oq += m * rank_;
  }
  comm_.all_reduce(pall, dist::ReduceOp::Sum);
  for (size_t i = 0; i < compressed_.size(); ++i) {
    Compressed& c = compressed_[i];
    orthonormalize_columns(ps[i]);
    ops::gemm(c.grad, true, ps[i], false, qs[i], 1.0f, 0.0f);  // this rank's Q
    c.error.copy_from(c.grad);
    ops::gemm(ps[i], false, qs[i], true, c.error, -1.0f, 1.0f);
  }
  comm_.all_reduce(qall, dist::ReduceOp::Sum);
  for (size_t i = 0; i < compressed_.size(); ++i) {
    Compressed& c = compressed_[i];
    ops::gemm(ps[i], false, qs[i], true, c.grad, 1.0f, 0.0f);
    c.q.copy_from(qs[i]);  // the warm start of the next step
  }
}

// ---- sharded ----------------------------------------------------------------------------------

int64_t FlatUnit::numel() const {
  int64_t n = 0;
  for (const auto& [name, k] : params) n += k;
  return n;
}

std::vector<int64_t> FlatUnit::offsets() const {
  std::vector<int64_t> out;
  int64_t off = 0;
  for (const auto& [name, k] : params) {
    out.push_back(off);
    off += (k + align - 1) / align * align;
  }
  return out;
}

int64_t FlatUnit::flat_numel() const {
  int64_t n = 0;
  for (const auto& [name, k] : params) n += (k + align - 1) / align * align;
  return n;
}

dist::FlatShard FlatUnit::shard_of(int world) const {
  dist::FlatShard f = dist::FlatShard::of(flat_numel(), world);
  if (align > 1) {
    f.shard = (f.shard + align - 1) / align * align;
    f.padded = f.shard * world;
  }
  return f;
}

namespace {

// The stored tensors of a 4-bit weight, under transformers' key suffixes.
struct QuantField {
  const char* suffix;
  Tensor quant::QuantizedWeight::*field;
};
constexpr QuantField kQuantFields[] = {
    {"", &quant::QuantizedWeight::packed},
    {".absmax", &quant::QuantizedWeight::absmax},
    {".quant_map", &quant::QuantizedWeight::quant_map},
    {".nested_absmax", &quant::QuantizedWeight::nested_absmax},
    {".nested_quant_map", &quant::QuantizedWeight::nested_quant_map},
};

// Float32 words a tensor's bytes take in a 4-bit unit: padded to 16 bytes, so every tensor
// gathered into the unit's buffer starts as aligned as a fresh allocation's vector loads need.
int64_t words_of(const Tensor& t) {
  return (int64_t(t.nbytes()) + 15) / 16 * 4;
}

// A tensor's bytes as a U8 vector sharing its storage (copies between dtypes, any device).
Tensor bytes_of(const Tensor& t) {
  return Tensor::view(t.raw(), {int64_t(t.nbytes())}, DType::U8, t.device(),
                      std::make_shared<Tensor>(t));
}

std::vector<std::vector<size_t>> unit_members(const LlamaModel& model, std::vector<FlatUnit>& units,
                                              const AdamW* opt = nullptr) {
  const bool eight = opt && opt->config().eight_bit;
  const std::vector<int> groups = model.param_groups();
  const auto& ps = model.params();
  int layers = 0;
  for (int g : groups) layers = std::max(layers, g + 1);
  std::vector<std::vector<size_t>> members;
  static const char* kinds[4] = {".decay", ".no_decay", ".frozen", ".frozen_4bit"};
  for (int g = -1; g < layers; ++g)
    for (int kind = 0; kind < 4; ++kind) {
      FlatUnit u;
      u.group = g;
      u.trainable = kind < 2;
      u.no_decay = kind == 1;
      u.four_bit = kind == 3;
      u.name = (g < 0 ? std::string("outer") : fmt::format("layer.{}", g)) + kinds[kind];
      if (eight && u.trainable) {
        u.align = ops::kAdam8Block;
        u.min_8bit_size = std::max<int64_t>(0, opt->config().min_8bit_size);
      }
      std::vector<size_t> m;
      for (size_t i = 0; i < ps.size(); ++i) {
        if (groups[i] != g || ps[i].trainable != u.trainable) continue;
        if (u.trainable && ps[i].no_decay != u.no_decay) continue;
        if (bool(ps[i].quant) != u.four_bit) continue;
        m.push_back(i);
        if (!u.four_bit) {
          u.params.emplace_back(ps[i].name, ps[i].value.numel());
          continue;
        }
        for (const auto& f : kQuantFields) {
          const Tensor& t = (*ps[i].quant).*f.field;
          if (t.defined()) u.params.emplace_back(ps[i].name + f.suffix, words_of(t));
        }
      }
      if (m.empty()) continue;
      units.push_back(std::move(u));
      members.push_back(std::move(m));
    }
  return members;
}

}  // namespace

std::vector<FlatUnit> flat_units(const LlamaModel& model) {
  std::vector<FlatUnit> units;
  unit_members(model, units);
  return units;
}

struct Sharded::Unit {
  std::vector<size_t> members;  // model parameter indices
  std::vector<Shape> shapes;
  std::vector<int64_t> offsets;
  dist::FlatShard fs;
  Tensor shard;             // frozen units; trainable ones live in shard_params_
  int param = -1;           // index into shard_params_
  Tensor full, gfull;       // gathered weights and full gradients while in use
  dist::WorkPtr gathering;  // a prefetch in flight into `full`
  // 4-bit units: where each stored tensor of each weight lies in `full` (offset in words).
  struct Piece {
    size_t param;
    Tensor quant::QuantizedWeight::*field;
    Shape shape;
    DType dtype;
    int64_t offset;
  };
  std::vector<Piece> pieces;
};

struct Sharded::PendingGrad {
  dist::WorkPtr work;
  Tensor part, gfull;
  int param = -1;
};

Sharded::Sharded(dist::Communicator& comm, LlamaModel& model, AdamW* opt)
    : comm_(comm), model_(model) {
  RIG_CHECK(model.compute_dtype() == DType::F32, "sharded training needs float32 compute");
  auto members = unit_members(model, units_, opt);
  auto& ps = model.params();
  const Device dev = model.device();
  const int r = comm.rank();
  for (size_t k = 0; k < units_.size(); ++k) {
    auto u = std::make_unique<Unit>();
    u->members = members[k];
    if (units_[k].four_bit) {
      // The bytes of every stored tensor, one after the other; this rank keeps its slice.
      int64_t off = 0;
      for (size_t i : u->members)
        for (const auto& f : kQuantFields) {
          const Tensor& t = (*ps[i].quant).*f.field;
          if (!t.defined()) continue;
          u->pieces.push_back({i, f.field, t.shape(), t.dtype(), off});
          off += words_of(t);
        }
      u->fs = dist::FlatShard::of(off, comm.world());
      u->shard = Tensor::zeros({u->fs.shard}, DType::F32, dev, "4-bit weight shard");
      Tensor mine = bytes_of(u->shard);
      const int64_t b = u->fs.begin(r) * 4, e = b + u->fs.valid(r) * 4;
      for (const auto& pc : u->pieces) {
        const Tensor& t = (*ps[pc.param].quant).*pc.field;
        const int64_t pb = pc.offset * 4, pe = pb + int64_t(t.nbytes());
        const int64_t lo = std::max(b, pb), hi = std::min(e, pe);
        if (lo < hi)
          mine.slice_rows(lo - b, hi - b).copy_from(bytes_of(t).slice_rows(lo - pb, hi - pb));
      }
      of_group_[units_[k].group].push_back(k);
      state_.push_back(std::move(u));
      continue;
    }
    for (size_t i : u->members) u->shapes.push_back(ps[i].value.shape());
    u->offsets = units_[k].offsets();
    u->fs = units_[k].shard_of(comm.world());
    // This rank's slice of the flat vector (the full model is on every rank once, at start).
    Tensor shard = Tensor::zeros({u->fs.shard}, DType::F32, dev, "parameter shard");
    const int64_t b = u->fs.begin(r), e = b + u->fs.valid(r);
    for (size_t j = 0; j < u->members.size(); ++j) {
      const int64_t pb = u->offsets[j], pe = pb + ps[u->members[j]].value.numel();
      const int64_t lo = std::max(b, pb), hi = std::min(e, pe);
      if (lo >= hi) continue;
      Tensor src = ps[u->members[j]].value.reshape({pe - pb}).slice_rows(lo - pb, hi - pb);
      shard.slice_rows(lo - b, hi - b).copy_from(src);
    }
    if (units_[k].trainable) {
      u->param = int(shard_params_.size());
      Param sp;
      sp.name = units_[k].name;
      sp.value = shard;
      sp.grad = Tensor::zeros({u->fs.shard}, DType::F32, dev, "gradient shard");
      sp.no_decay = units_[k].no_decay;
      if (units_[k].align > 1) {
        // Which tensor each part of this shard is, for the 8-bit optimizer.
        std::vector<AdamW::Piece> pieces;
        for (size_t j = 0; j < u->members.size(); ++j) {
          const int64_t n = units_[k].params[j].second, pb = u->offsets[j];
          const int64_t lo = std::max(b, pb), hi = std::min(e, pb + n);
          if (lo < hi) pieces.push_back({lo - b, hi - b, n});
        }
        opt->set_pieces(sp.name, u->fs.shard, std::move(pieces));
      }
      shard_params_.push_back(std::move(sp));
    } else {
      u->shard = shard;
    }
    of_group_[units_[k].group].push_back(k);
    state_.push_back(std::move(u));
  }
  for (auto& p : ps) {
    p.value = p.compute = Tensor();
    p.grad = Tensor();
    // A 4-bit weight keeps its scalars (shape, block size, offset); its tensors are gathered.
    if (p.quant)
      for (const auto& f : kQuantFields) (*p.quant).*f.field = Tensor();
  }
  model.bind_outer();  // drops the model's own references to the full tensors
}

Sharded::~Sharded() = default;

std::vector<Tensor> Sharded::frozen_shards() const {
  std::vector<Tensor> out;
  for (const auto& u : state_)
    // 4-bit units as the bytes they hold: the guard's scan for implausible floats skips them.
    if (u->param < 0) out.push_back(u->pieces.empty() ? u->shard : bytes_of(u->shard));
  return out;
}

void Sharded::zero_grad() {
  finish();
  for (auto& p : shard_params_) p.grad.zero_();
}

double Sharded::clip_grad_norm(float max_norm) {
  finish();
  double local = 0;
  std::vector<Tensor> grads;
  for (auto& p : shard_params_) grads.push_back(p.grad);
  for (double s : ops::sum_squares_list(grads)) local += s;
  Tensor t = Tensor::from_f32({float(local)}, {1});
  if (!comm_.device().is_cpu()) t = t.to(comm_.device(), "norm");
  comm_.all_reduce(t, dist::ReduceOp::Sum);
  const double norm = std::sqrt(double(t.to(Device::cpu(), "norm").f32()[0]));
  if (max_norm > 0) {
    // As torch.nn.utils.clip_grad_norm_.
    float coef = float(max_norm / (float(norm) + 1e-6f));
    if (coef < 1.0f)
      for (auto& p : shard_params_) ops::scale_(p.grad, coef);
  }
  return norm;
}

void Sharded::gather(Unit& u) {
  if (!u.full.defined()) {
    const Tensor& shard = u.param >= 0 ? shard_params_[size_t(u.param)].value : u.shard;
    u.full = Tensor::empty({u.fs.padded}, DType::F32, shard.device(), "gathered parameters");
    u.gathering = dist::all_gather_flat(comm_, u.fs, shard, u.full);
  }
  if (!u.gathering) return;
  u.gathering->wait();
  u.gathering.reset();
  auto& ps = model_.params();
  if (!u.pieces.empty()) {
    // The 4-bit weights' tensors become views of the gathered bytes, until release.
    auto owner = std::make_shared<Tensor>(u.full);
    for (const auto& pc : u.pieces)
      (*ps[pc.param].quant).*pc.field =
          Tensor::view(static_cast<char*>(u.full.raw()) + pc.offset * 4, pc.shape, pc.dtype,
                       u.full.device(), owner);
    return;
  }
  for (size_t j = 0; j < u.members.size(); ++j) {
    const int64_t n = shape_numel(u.shapes[j]);
    // Float32 compute (checked by the trainer): the products read the gathered values.
    ps[u.members[j]].value = u.full.slice_rows(u.offsets[j], u.offsets[j] + n).reshape(u.shapes[j]);
  }
}

// Starts the all-gather of a group's weights so it overlaps the current layer's compute.
void Sharded::prefetch(int group) {
  auto it = of_group_.find(group);
  if (it == of_group_.end()) return;
  for (size_t k : it->second) {
    Unit& u = *state_[k];
    if (u.full.defined()) continue;
    const Tensor& shard = u.param >= 0 ? shard_params_[size_t(u.param)].value : u.shard;
    u.full = Tensor::empty({u.fs.padded}, DType::F32, shard.device(), "gathered parameters");
    u.gathering = dist::all_gather_flat(comm_, u.fs, shard, u.full);
  }
}

void Sharded::release(Unit& u) {
  if (u.gathering) {
    u.gathering->wait();
    u.gathering.reset();
  }
  for (size_t i : u.members) model_.params()[i].value = model_.params()[i].compute = Tensor();
  for (const auto& pc : u.pieces) (*model_.params()[pc.param].quant).*pc.field = Tensor();
  u.full = Tensor();
}

void Sharded::finish() {
  for (auto& p : pending_) {
    p.work->wait();
    ops::add_(shard_params_[size_t(p.param)].grad, p.part);
  }
  pending_.clear();
}

void Sharded::before(int group, Phase phase) {
  auto it = of_group_.find(group);
  if (it == of_group_.end()) return;
  auto& ps = model_.params();
  for (size_t k : it->second) gather(*state_[k]);
  // The next layer in this pass (forward: up, backward: down) while this one computes; the
  // outer parameters are gathered at the start of the step, before layer 0.
  if (!pinned_) prefetch(group < 0 ? 0 : phase == Forward ? group + 1 : group - 1);
  for (size_t k : it->second) {
    Unit& u = *state_[k];
    if (phase == Backward && u.param >= 0) {
      u.gfull = Tensor::zeros({u.fs.padded}, DType::F32, u.full.device(), "full gradients");
      for (size_t j = 0; j < u.members.size(); ++j) {
        const int64_t n = shape_numel(u.shapes[j]);
        ps[u.members[j]].grad =
            u.gfull.slice_rows(u.offsets[j], u.offsets[j] + n).reshape(u.shapes[j]);
      }
    }
  }
}

void Sharded::after(int group, Phase phase) {
  auto it = of_group_.find(group);
  if (it == of_group_.end()) return;
  auto& ps = model_.params();
  // The previous layer's reduce-scatters have had this layer's backward to run.
  if (phase == Backward) finish();
  for (size_t k : it->second) {
    Unit& u = *state_[k];
    if (phase == Backward && u.gfull.defined()) {
      // Summed over ranks into this rank's part, added to the shard gradient (which holds the
      // earlier micro-steps') once it arrives.
      PendingGrad p;
      p.param = u.param;
      p.gfull = u.gfull;
      p.part = Tensor::empty({u.fs.shard}, DType::F32, u.gfull.device(), "gradient part");
      p.work = dist::reduce_scatter_flat(comm_, u.fs, u.gfull, p.part, dist::ReduceOp::Sum);
      pending_.push_back(std::move(p));
      for (size_t i : u.members) ps[i].grad = Tensor();
      u.gfull = Tensor();
    }
    if (!pinned_) release(u);
  }
}

void Sharded::gather_all() {
  finish();
  for (auto& u : state_) gather(*u);
  pinned_ = true;
  model_.bind_outer();  // evaluation and generation run without hooks
}

void Sharded::release_all() {
  pinned_ = false;
  for (auto& u : state_) release(*u);
  model_.bind_outer();
}

std::vector<std::pair<std::string, Tensor>> Sharded::shard_tensors(const AdamW& opt) const {
  std::vector<std::pair<std::string, Tensor>> out;
  for (const auto& p : shard_params_)
    out.emplace_back("param." + p.name, p.value.to(Device::cpu(), "checkpoint"));
  for (auto& [name, t] : opt.state_tensors())
    out.emplace_back(name, t.to(Device::cpu(), "checkpoint"));
  return out;
}

json Sharded::layout() const {
  json units = json::array();
  for (const auto& u : units_) {
    json ps = json::array();
    for (const auto& [n, k] : u.params) ps.push_back({n, k});
    json j = {{"name", u.name}, {"trainable", u.trainable}, {"params", ps}};
    if (u.four_bit) j["four_bit"] = true;  // params in float32 words of stored bytes
    if (u.align > 1) {
      j["align"] = u.align;
      j["min_8bit_size"] = u.min_8bit_size;
    }
    units.push_back(std::move(j));
  }
  return {{"world", comm_.world()}, {"units", units}};
}

namespace {

// What a checkpoint prefix holds: its element type, and whether it counts blocks of 256.
struct StateKind {
  DType dtype = DType::F32;
  bool per_block = false;
};
StateKind kind_of(const std::string& prefix) {
  if (prefix == "adamw8bit.mq." || prefix == "adamw8bit.vq.") return {DType::U8, false};
  if (prefix == "adamw8bit.mabs." || prefix == "adamw8bit.vabs.") return {DType::F32, true};
  return {};
}
int64_t blocks_of(int64_t n) {
  return (n + ops::kAdam8Block - 1) / ops::kAdam8Block;
}
// A tensor's length under a prefix: elements, or blocks.
int64_t length_of(int64_t numel, const StateKind& k) {
  return k.per_block ? blocks_of(numel) : numel;
}
// Which of a unit's params a prefix holds: 8-bit moments only for the 8-bit ones, float32
// moments only for the others.
bool holds(const std::string& prefix, const FlatUnit& u, size_t j) {
  if (prefix.rfind("adamw8bit.", 0) == 0) return u.eight_bit(j);
  if (prefix.rfind("adamw.", 0) == 0) return !u.eight_bit(j);
  return true;
}
constexpr const char* kStatePrefixes[] = {"param.",         "adamw.m.",        "adamw.v.",
                                          "adamw8bit.mq.",  "adamw8bit.mabs.", "adamw8bit.vq.",
                                          "adamw8bit.vabs."};

}  // namespace

void Sharded::load(const RangeReader& read, AdamW& opt, int64_t opt_step, Device dev) {
  const int r = comm_.rank();
  std::map<std::string, Tensor> opt_state;
  for (size_t k = 0; k < units_.size(); ++k) {
    const FlatUnit& fu = units_[k];
    if (!fu.trainable) continue;
    Unit& u = *state_[k];
    const int64_t b = u.fs.begin(r), e = b + u.fs.valid(r);
    // This rank's part of the unit under a prefix, tensor by tensor (undefined: not in the
    // checkpoint); block-aligned units keep each 8-bit tensor's blocks at flat offset / 256.
    auto fill = [&](const std::string& prefix) {
      const StateKind kind = kind_of(prefix);
      const int64_t scale = kind.per_block ? fu.align : 1;
      Tensor host =
          Tensor::zeros({u.fs.shard / scale}, kind.dtype, Device::cpu(), "checkpoint shard");
      auto* out = static_cast<char*>(host.raw());
      const size_t es = dtype_size(kind.dtype);
      for (size_t j = 0; j < fu.params.size(); ++j) {
        if (!holds(prefix, fu, j)) continue;
        const int64_t pb = u.offsets[j], n = fu.params[j].second;
        const int64_t lo = std::max(b, pb), hi = std::min(e, pb + n);
        if (lo >= hi) continue;
        int64_t tb = lo - pb, te = hi - pb;
        if (kind.per_block) {
          tb /= ops::kAdam8Block;
          te = blocks_of(te);
        }
        if (!read(prefix, fu, j, tb, te, out + size_t((lo - b) / scale) * es)) return Tensor();
      }
      return host;
    };
    Param& sp = shard_params_[size_t(u.param)];
    Tensor values = fill("param.");
    if (!values.defined()) bad_input("checkpoint has no parameters for '{}'", fu.name);
    sp.value.copy_from(values);
    std::vector<std::string> prefixes;
    if (fu.min_8bit_size < 0 || std::any_of(fu.params.begin(), fu.params.end(), [&](const auto& p) {
          return p.second < fu.min_8bit_size;
        }))
      prefixes = {"adamw.m.", "adamw.v."};
    if (fu.min_8bit_size >= 0)
      for (const char* p : {"adamw8bit.mq.", "adamw8bit.mabs.", "adamw8bit.vq.", "adamw8bit.vabs."})
        prefixes.push_back(p);
    std::map<std::string, Tensor> mine;
    for (const auto& prefix : prefixes) {
      Tensor t = fill(prefix);
      if (!t.defined()) {
        mine.clear();  // before the first step
        break;
      }
      mine[prefix + fu.name] = t.to(dev, "optimizer state");
    }
    opt_state.merge(mine);
  }
  opt.load_state(opt_state, opt_step, dev);
}

// ---- loader positions -------------------------------------------------------------------------

void encode_count(int64_t v, float* out3) {
  const uint64_t u = uint64_t(v);
  out3[0] = float(u & 0xFFFF);
  out3[1] = float((u >> 16) & 0xFFFF);
  out3[2] = float((u >> 32) & 0xFFFF);
}

int64_t decode_count(const float* in3) {
  return int64_t(std::llround(in3[0])) + (int64_t(std::llround(in3[1])) << 16) +
         (int64_t(std::llround(in3[2])) << 32);
}

std::vector<LoaderState> gather_loader_states(dist::Communicator* comm, const LoaderState& mine) {
  if (!comm) return {mine};
  const int world = comm->world();
  Tensor in = Tensor::empty({6}, DType::F32, Device::cpu(), "loader state");
  encode_count(int64_t(mine.epoch), in.f32());
  encode_count(int64_t(mine.index), in.f32() + 3);
  Tensor out = Tensor::empty({6 * world}, DType::F32, Device::cpu(), "loader states");
  if (comm->device().is_cpu()) {
    comm->all_gather(in, out);
  } else {
    Tensor d = out.to(comm->device(), "loader states");
    comm->all_gather(in.to(comm->device(), "loader state"), d);
    out = d.to(Device::cpu(), "loader states");
  }
  std::vector<LoaderState> all(static_cast<size_t>(world));
  for (int r = 0; r < world; ++r) {
    all[size_t(r)].epoch = uint64_t(decode_count(out.f32() + 6 * r));
    all[size_t(r)].index = uint64_t(decode_count(out.f32() + 6 * r + 3));
  }
  return all;
}

LoaderState resplit_loader_state(const std::vector<LoaderState>& saved, int rank, int world,
                                 const std::string& ckpt_dir) {
  const int old_world = int(saved.size());
  if (old_world == world) return saved[size_t(rank)];
  for (const auto& s : saved)
    if (!(s == saved[0]))
      bad_input(
          "{}: written by {} ranks whose data positions differ (packing), so the data stream "
          "cannot be re-split for {} ranks; resume it on {} ranks or set packing: false",
          ckpt_dir, old_world, world, old_world);
  const uint64_t global = saved[0].index * uint64_t(old_world);
  if (global % uint64_t(world) != 0)
    bad_input(
        "{}: {} samples of epoch {} are done, which {} ranks cannot split evenly; resume on a "
        "world size that divides it",
        ckpt_dir, global, saved[0].epoch, world);
  return LoaderState{saved[0].epoch, global / uint64_t(world)};
}

// ---- sharded checkpoint files -------------------------------------------------------------------

std::string shard_file_name(int rank, int world) {
  return fmt::format("shard-{}-of-{}.safetensors", rank, world);
}

namespace {

std::vector<FlatUnit> units_of_layout(const json& layout) {
  std::vector<FlatUnit> out;
  for (const auto& u : layout.at("units")) {
    FlatUnit f;
    f.name = u.at("name");
    f.trainable = u.at("trainable");
    f.four_bit = u.value("four_bit", false);
    f.align = u.value("align", int64_t(1));
    f.min_8bit_size = u.value("min_8bit_size", int64_t(-1));
    for (const auto& p : u.at("params"))
      f.params.emplace_back(p.at(0).get<std::string>(), p.at(1).get<int64_t>());
    out.push_back(std::move(f));
  }
  return out;
}

}  // namespace

void check_layout(const json& saved_layout, const std::vector<FlatUnit>& units,
                  const std::string& ckpt_dir) {
  std::map<std::string, const FlatUnit*> saved;
  auto su = units_of_layout(saved_layout);
  for (const auto& u : su) saved[u.name] = &u;
  for (const auto& u : units) {
    if (!u.trainable) continue;
    auto it = saved.find(u.name);
    if (it == saved.end())
      bad_input(
          "{}: the checkpoint has no parameter unit '{}': it was written for another model or "
          "method",
          ckpt_dir, u.name);
    if (it->second->params != u.params)
      bad_input(
          "{}: parameter unit '{}' holds other tensors or shapes than this model's ({} vs {} "
          "elements): "
          "it was written for another model",
          ckpt_dir, u.name, it->second->numel(), u.numel());
  }
}

Sharded::RangeReader sharded_checkpoint_reader(const std::string& ckpt_dir,
                                               const json& saved_layout) {
  const int old_world = saved_layout.at("world").get<int>();
  json manifest = json::parse(read_file((fs::path(ckpt_dir) / "manifest.json").string()));
  auto files = std::make_shared<std::vector<std::optional<SafeTensorsFile>>>(size_t(old_world));
  auto open = [ckpt_dir, old_world, manifest, files](int r) -> SafeTensorsFile& {
    auto& f = (*files)[size_t(r)];
    if (!f) {
      std::string name = shard_file_name(r, old_world), path = (fs::path(ckpt_dir) / name).string();
      if (!manifest["files"].contains(name))
        bad_input("{}: the manifest does not list {}", ckpt_dir, name);
      if (!fs::exists(path)) bad_input("{}: shard file {} is missing", ckpt_dir, name);
      if (xxh3_file_hex(path) != manifest["files"][name].at("xxh3").get<std::string>())
        bad_input("{}: checksum does not match the manifest (corrupted on disk?)", path);
      f = SafeTensorsFile::open(path);
    }
    return *f;
  };
  // The units as that run laid them out (its alignment, its world).
  auto saved = std::make_shared<std::map<std::string, FlatUnit>>();
  for (auto& u : units_of_layout(saved_layout)) saved->emplace(u.name, std::move(u));
  return [open, old_world, saved](const std::string& prefix, const FlatUnit& unit, size_t param,
                                  int64_t begin, int64_t end, void* out) {
    auto su = saved->find(unit.name);
    if (su == saved->end() || param >= su->second.params.size()) return false;
    const FlatUnit& u = su->second;
    if (!holds(prefix, u, param)) return false;  // that run kept other moments for it
    const StateKind kind = kind_of(prefix);
    const int64_t scale = kind.per_block ? u.align : 1;
    if (kind.per_block && u.align != ops::kAdam8Block) return false;
    const dist::FlatShard fs = u.shard_of(old_world);
    const int64_t shard = fs.shard / scale, at = u.offsets()[param] / scale;
    const size_t es = dtype_size(kind.dtype);
    for (int r = 0; r < old_world && begin < end; ++r) {
      const int64_t b = r * shard, e = b + shard;
      const int64_t lo = std::max(at + begin, b), hi = std::min(at + end, e);
      if (lo >= hi) continue;
      SafeTensorsFile& f = open(r);
      const std::string key = prefix + u.name;
      if (!f.has(key)) return false;
      Tensor t = kind.dtype == DType::F32 ? f.get_f32(key) : f.get(key);
      if (t.numel() != shard || t.dtype() != kind.dtype)
        bad_input("tensor '{}' has {} elements of {}, expected {} of {}", key, t.numel(),
                  dtype_name(t.dtype()), shard, dtype_name(kind.dtype));
      std::memcpy(static_cast<char*>(out) + size_t(lo - at - begin) * es,
                  static_cast<const char*>(t.raw()) + size_t(lo - b) * es, size_t(hi - lo) * es);
    }
    return true;
  };
}

Sharded::RangeReader named_tensor_reader(const std::map<std::string, Tensor>& tensors) {
  return [&tensors](const std::string& prefix, const FlatUnit& u, size_t param, int64_t begin,
                    int64_t end, void* out) {
    const auto& [name, n] = u.params[param];
    auto it = tensors.find(prefix + name);
    if (it == tensors.end()) return false;
    Tensor t =
        it->second.device().is_cpu() ? it->second : it->second.to(Device::cpu(), "checkpoint");
    const StateKind kind = kind_of(prefix);
    if (t.numel() != length_of(n, kind) || t.dtype() != kind.dtype)
      bad_input("tensor '{}{}' has {} elements of {}, expected {} of {}", prefix, name, t.numel(),
                dtype_name(t.dtype()), length_of(n, kind), dtype_name(kind.dtype));
    const size_t es = dtype_size(kind.dtype);
    std::memcpy(out, static_cast<const char*>(t.raw()) + size_t(begin) * es,
                size_t(end - begin) * es);
    return true;
  };
}

std::map<std::string, Tensor> read_sharded_as_named(const std::string& ckpt_dir,
                                                    const json& saved_layout) {
  auto read = sharded_checkpoint_reader(ckpt_dir, saved_layout);
  std::map<std::string, Tensor> out;
  for (const auto& u : units_of_layout(saved_layout)) {
    if (!u.trainable) continue;
    for (const std::string prefix : kStatePrefixes)
      for (size_t j = 0; j < u.params.size(); ++j) {
        if (!holds(prefix, u, j)) continue;
        const StateKind kind = kind_of(prefix);
        const int64_t n = length_of(u.params[j].second, kind);
        Tensor t = Tensor::empty({n}, kind.dtype, Device::cpu(), "checkpoint");
        if (read(prefix, u, j, 0, n, t.raw())) out[prefix + u.params[j].first] = t;
      }
  }
  return out;
}

}  // namespace rig
