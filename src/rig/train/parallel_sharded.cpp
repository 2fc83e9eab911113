#include <algorithm>
#include <cmath>
#include <cstdlib>

#include "rig/model/loss_chunk.h"
#include "rig/ops/adamw8bit.h"
#include "rig/ops/ops.h"
#include "rig/quant/random_codes.h"
#include "rig/train/parallel.h"
#include "rig/train/parallel_impl.h"

// Sharded: flat units, the shards, gathering before use and reduce-scattering gradients after,
// and loading shards from a checkpoint reader (parallel_resume.cpp makes the readers).

namespace rig {

using json = nlohmann::json;
using shard_state::blocks_of;
using shard_state::holds;
using shard_state::kind_of;
using shard_state::StateKind;

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

int64_t head_slice_bytes() {
  const char* e = std::getenv("RIG_HEAD_SLICE_BYTES");
  if (!e || !*e) return int64_t(256) << 20;
  char* end = nullptr;
  const long long v = std::strtoll(e, &end, 10);
  if (*end || v <= 0) bad_input("RIG_HEAD_SLICE_BYTES={}: expected a positive number of bytes", e);
  return v;
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

// Float32 words a tensor's bytes take in a unit of bytes: padded to 16 bytes, so every tensor
// gathered into the unit's buffer starts as aligned as a fresh allocation's vector loads need.
int64_t words_of(size_t nbytes) { return (int64_t(nbytes) + 15) / 16 * 4; }
int64_t words_of(const Tensor& t) { return words_of(t.nbytes()); }

// The stored tensors of a 4-bit weight: the ones it holds, or those a random model will draw.
struct Stored {
  const char* suffix;
  Tensor quant::QuantizedWeight::*field;
  Shape shape;
  DType dtype;
  size_t nbytes;
};
std::vector<Stored> stored_of(const LlamaModel& model, size_t i) {
  const quant::QuantizedWeight& q = *model.params()[i].quant;
  std::vector<Stored> out;
  for (const auto& f : kQuantFields) {
    const Tensor& t = q.*f.field;
    if (t.defined()) out.push_back({f.suffix, f.field, t.shape(), t.dtype(), t.nbytes()});
  }
  if (!out.empty() || !model.codes_deferred()) return out;
  for (const auto& st : quant::stored_tensors(q))
    for (const auto& f : kQuantFields)
      if (f.field == st.field) out.push_back({f.suffix, f.field, st.shape, st.dtype, st.nbytes()});
  return out;
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
        for (const auto& st : stored_of(model, i))
          u.params.emplace_back(ps[i].name + st.suffix, words_of(st.nbytes));
      }
      if (m.empty()) continue;
      auto emit = [&](FlatUnit v, std::vector<size_t> mm) {
        // Frozen matrices stored in bf16 (bf16 compute) sit beside float32 norms: the unit then
        // carries every tensor's bytes, as a 4-bit unit does.
        if (kind == 2 && std::any_of(mm.begin(), mm.end(), [&](size_t i) {
              return ps[i].value.dtype() != DType::F32;
            })) {
          v.bytes = true;
          v.params.clear();
          for (size_t i : mm) v.params.emplace_back(ps[i].name, words_of(ps[i].value));
        }
        units.push_back(std::move(v));
        members.push_back(std::move(mm));
      };
      // A frozen input embedding (untied) is a unit of its own: read only by the lookup at the
      // start of the step, it is released for the layers instead of staying gathered with the
      // head (a vocabulary x hidden matrix: 2 GiB in bf16 for Llama 3 70B).
      if (g < 0 && kind == 2 && !model.config().tie_word_embeddings && m.size() > 1 &&
          m.front() == 0) {
        FlatUnit e = u;
        e.name = "outer.embedding.frozen";
        e.embedding = true;
        e.params.assign(u.params.begin(), u.params.begin() + 1);
        u.params.erase(u.params.begin());
        emit(std::move(e), {m.front()});
        m.erase(m.begin());
        u.head = true;
      }
      std::vector<FlatUnit> slices;
      auto lm = std::find_if(m.begin(), m.end(),
                             [&](size_t i) { return ps[i].name == "lm_head.weight"; });
      if (u.head && lm != m.end()) {
        // The frozen lm_head in slices of vocabulary rows, each a unit of its own.
        const Tensor& w = ps[*lm].value;
        const int64_t V = w.dim(0), row = int64_t(w.nbytes()) / V;
        const int64_t per = head_slice_rows_for(V, row, head_slice_bytes());
        for (int64_t r0 = 0; per < V && r0 < V; r0 += per) {
          FlatUnit sl;
          sl.name = fmt::format("outer.lm_head.{}", slices.size());
          sl.bytes = sl.head = true;
          sl.head_slice = int(slices.size());
          sl.row0 = r0;
          sl.rows = std::min(per, V - r0);
          sl.params = {{fmt::format("lm_head.weight[{}:{}]", r0, r0 + sl.rows),
                        words_of(size_t(sl.rows * row))}};
          slices.push_back(std::move(sl));
        }
        if (!slices.empty()) {
          u.params.erase(u.params.begin() + (lm - m.begin()));
          const size_t li = *lm;
          m.erase(lm);
          if (!m.empty()) emit(std::move(u), std::move(m));
          for (auto& sl : slices) {
            units.push_back(std::move(sl));
            members.push_back({li});
          }
          continue;
        }
      }
      emit(std::move(u), std::move(m));
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
  // Units of bytes (4-bit weights, bf16 frozen matrices): where each stored tensor lies in
  // `full` (offset in words).
  struct Piece {
    size_t param;
    Tensor quant::QuantizedWeight::*field;  // nullptr: the parameter's `value`
    Shape shape;
    DType dtype;
    int64_t offset;
    int64_t src = 0;  // where the piece starts in the parameter's bytes (a head slice)
  };
  std::vector<Piece> pieces;
  int head_slice = -1;  // FlatUnit::head_slice
  Tensor slice;         // a head slice's rows while gathered (in the compute dtype)
};

struct Sharded::PendingGrad {
  dist::WorkPtr work;
  Tensor part, gfull;
  int param = -1;
};

Sharded::Sharded(dist::Communicator& comm, LlamaModel& model, AdamW* opt)
    : comm_(comm), model_(model) {
  auto members = unit_members(model, units_, opt);
  auto& ps = model.params();
  const Device dev = model.device();
  const int r = comm.rank();
  // Weights quantized on demand from the folder: the nested offset of each, from the rank whose
  // slice starts its packed bytes (it quantized the weight), to every rank.
  const bool share_offsets = model.offsets_pending();
  std::vector<float> offsets(ps.size(), 0.0f);
  auto stored = [&](const Unit::Piece& pc) -> const Tensor& {
    return pc.field ? (*ps[pc.param].quant).*pc.field : ps[pc.param].value;
  };
  for (size_t k = 0; k < units_.size(); ++k) {
    auto u = std::make_unique<Unit>();
    u->members = members[k];
    if (units_[k].four_bit || units_[k].bytes) {
      // The bytes of every stored tensor, one after the other; this rank keeps its slice.
      int64_t off = 0;
      for (size_t i : u->members) {
        if (units_[k].head_slice >= 0) {
          const Tensor& w = ps[i].value;
          const int64_t row = int64_t(w.nbytes()) / w.dim(0), rows = units_[k].rows;
          u->pieces.push_back({i, nullptr, {rows, w.dim(1)}, w.dtype(), off, units_[k].row0 * row});
          off += words_of(size_t(rows * row));
          continue;
        }
        if (units_[k].bytes) {
          u->pieces.push_back({i, nullptr, ps[i].value.shape(), ps[i].value.dtype(), off});
          off += words_of(ps[i].value);
          continue;
        }
        for (const auto& st : stored_of(model, i)) {
          u->pieces.push_back({i, st.field, st.shape, st.dtype, off});
          off += words_of(st.nbytes);
        }
      }
      u->fs = dist::FlatShard::of(off, comm.world());
      u->shard = Tensor::zeros({u->fs.shard}, DType::F32, dev, "frozen weight shard");
      Tensor mine = bytes_of(u->shard);
      const int64_t b = u->fs.begin(r) * 4, e = b + u->fs.valid(r) * 4;
      for (const auto& pc : u->pieces) {
        const Tensor& t = stored(pc);
        const int64_t pb = pc.offset * 4,
                      pe = pb + int64_t(dtype_nbytes(pc.dtype, shape_numel(pc.shape)));
        const int64_t lo = std::max(b, pb), hi = std::min(e, pe);
        if (lo >= hi) continue;
        if (t.defined()) {
          mine.slice_rows(lo - b, hi - b)
              .copy_from(bytes_of(t).slice_rows(lo - pb + pc.src, hi - pb + pc.src));
        } else {
          // A deferred 4-bit weight (drawn, or quantized from the folder): just this rank's bytes.
          Tensor host = Tensor::empty({hi - lo}, DType::U8, Device::cpu(), "4-bit bytes");
          model.deferred_4bit_bytes(pc.param, pc.field, lo - pb, hi - pb, host.data<uint8_t>());
          mine.slice_rows(lo - b, hi - b).copy_from(host);
          if (pc.field == &quant::QuantizedWeight::packed && lo == pb)
            offsets[pc.param] = ps[pc.param].quant->nested_offset;
        }
      }
      u->head_slice = units_[k].head_slice;
      if (u->head_slice >= 0) slice_units_.push_back(k);
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
  head_slices_ = int(slice_units_.size());
  model.drop_4bit_cache();
  if (share_offsets) {
    Tensor t = Tensor::from_f32(offsets, {int64_t(offsets.size())});
    if (!comm.device().is_cpu()) t = t.to(comm.device(), "4-bit offsets");
    comm.all_reduce(t, dist::ReduceOp::Sum);  // one rank's value, zeros from the others
    t = t.to(Device::cpu(), "4-bit offsets");
    model.set_4bit_offsets(std::vector<float>(t.f32(), t.f32() + t.numel()));
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

void Sharded::start_gather(Unit& u) {
  if (u.full.defined()) return;
  const Tensor& shard = u.param >= 0 ? shard_params_[size_t(u.param)].value : u.shard;
  u.full = Tensor::empty({u.fs.padded}, DType::F32, shard.device(), "gathered parameters");
  u.gathering = dist::all_gather_flat(comm_, u.fs, shard, u.full);
}

void Sharded::gather(Unit& u) {
  start_gather(u);
  if (!u.gathering) return;
  u.gathering->wait();
  u.gathering.reset();
  auto& ps = model_.params();
  if (!u.pieces.empty()) {
    // The stored tensors become views of the gathered bytes, until release.
    auto owner = std::make_shared<Tensor>(u.full);
    for (const auto& pc : u.pieces) {
      Tensor v = Tensor::view(static_cast<char*>(u.full.raw()) + pc.offset * 4, pc.shape, pc.dtype,
                              u.full.device(), owner);
      if (u.head_slice >= 0) {
        u.slice = v;
        continue;
      }
      (pc.field ? (*ps[pc.param].quant).*pc.field : ps[pc.param].value) = v;
    }
    return;
  }
  const DType compute = model_.compute_dtype();
  for (size_t j = 0; j < u.members.size(); ++j) {
    Param& p = ps[u.members[j]];
    const int64_t n = shape_numel(u.shapes[j]);
    p.value = u.full.slice_rows(u.offsets[j], u.offsets[j] + n).reshape(u.shapes[j]);
    // Under bf16 compute the products read a bf16 copy of each trainable matrix, made here from
    // the gathered float32 master and dropped with it (FSDP's param_dtype).
    if (p.compute_operand && compute != DType::F32) {
      p.compute = Tensor::empty(u.shapes[j], compute, u.full.device(), "compute weight");
      ops::cast(p.value, p.compute);
    }
  }
}

// Starts the all-gather of a group's weights so it overlaps the current layer's compute.
void Sharded::prefetch(int group) {
  auto it = of_group_.find(group);
  if (it == of_group_.end()) return;
  for (size_t k : it->second) start_gather(*state_[k]);
}

void Sharded::release(Unit& u) {
  if (u.gathering) {
    u.gathering->wait();
    u.gathering.reset();
  }
  if (u.head_slice >= 0) {  // lm_head itself is bound only by gather_all
    u.slice = u.full = Tensor();
    return;
  }
  for (size_t i : u.members) model_.params()[i].value = model_.params()[i].compute = Tensor();
  for (const auto& pc : u.pieces)
    if (pc.field) (*model_.params()[pc.param].quant).*pc.field = Tensor();
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
  for (size_t k : it->second)
    if (!units_[k].head) gather(*state_[k]);
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

void Sharded::outer_done(OuterPart part) {
  if (pinned_) return;
  auto it = of_group_.find(-1);
  if (it == of_group_.end()) return;
  // Frozen units only: a trainable one holds its gradients until after(-1).
  for (size_t k : it->second)
    if (!units_[k].trainable && units_[k].embedding == (part == Embedding)) release(*state_[k]);
}

void Sharded::outer_needed(OuterPart part) {
  auto it = of_group_.find(-1);
  if (it == of_group_.end() || part != Head) return;
  for (size_t k : it->second)
    if (units_[k].head && units_[k].head_slice < 0) gather(*state_[k]);
}

Tensor Sharded::head_slice(int c, int next, int64_t& v0) {
  Unit& u = *state_[slice_units_[size_t(c)]];
  gather(u);
  if (next >= 0) start_gather(*state_[slice_units_[size_t(next)]]);
  v0 = units_[slice_units_[size_t(c)]].row0;
  const DType compute = model_.compute_dtype();
  if (u.slice.dtype() != compute) {
    Tensor w = Tensor::empty(u.slice.shape(), compute, u.slice.device(), "head slice");
    ops::cast(u.slice, w);
    u.slice = w;
  }
  return u.slice;
}

void Sharded::head_slice_done(int c) {
  release(*state_[slice_units_[size_t(c)]]);
}

void Sharded::gather_all(bool trainable_only) {
  finish();
  for (auto& u : state_)
    if ((!trainable_only || u->param >= 0) && u->head_slice < 0) gather(*u);
  if (!trainable_only && head_slices_ > 0) {
    // lm_head whole, a slice at a time: generation reads it without hooks.
    Param& lm = model_.params()[state_[slice_units_[0]]->members.front()];
    const Unit::Piece& p0 = state_[slice_units_[0]]->pieces.front();
    Tensor w = Tensor::empty({model_.config().vocab_size, p0.shape[1]}, p0.dtype,
                             state_[slice_units_[0]]->shard.device(), "lm_head");
    for (size_t k : slice_units_) {
      gather(*state_[k]);
      w.slice_rows(units_[k].row0, units_[k].row0 + units_[k].rows).copy_from(state_[k]->slice);
      release(*state_[k]);
    }
    lm.value = w;
    const DType compute = model_.compute_dtype();
    if (lm.compute_operand && w.dtype() != compute) {
      lm.compute = Tensor::empty(w.shape(), compute, w.device(), "compute weight");
      ops::cast(w, lm.compute);
    }
    head_whole_ = true;
  }
  pinned_ = true;
  model_.bind_outer();  // evaluation and generation run without hooks
}

void Sharded::release_all() {
  pinned_ = false;
  for (auto& u : state_) release(*u);
  if (head_whole_) {
    Param& lm = model_.params()[state_[slice_units_[0]]->members.front()];
    lm.value = lm.compute = Tensor();
    head_whole_ = false;
  }
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
    if (u.bytes) j["bytes"] = true;        // likewise (frozen matrices stored in bf16)
    if (u.align > 1) {
      j["align"] = u.align;
      j["min_8bit_size"] = u.min_8bit_size;
    }
    units.push_back(std::move(j));
  }
  return {{"world", comm_.world()}, {"units", units}};
}

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

}  // namespace rig
