#include <cmath>
#include <cstring>
#include <filesystem>
#include <optional>

#include "rig/io/atomic_file.h"
#include "rig/io/safetensors.h"
#include "rig/train/checkpoint.h"
#include "rig/train/parallel.h"
#include "rig/train/parallel_impl.h"

// Resuming on any world size: every rank's loader position, and sharded checkpoint files read
// back per tensor (for Sharded::load, or as named tensors for an unsharded run).

namespace rig {

namespace fs = std::filesystem;
using json = nlohmann::json;
using shard_state::holds;
using shard_state::kind_of;
using shard_state::length_of;
using shard_state::StateKind;

namespace {

constexpr const char* kStatePrefixes[] = {"param.",         "adamw.m.",        "adamw.v.",
                                          "adamw8bit.mq.",  "adamw8bit.mabs.", "adamw8bit.vq.",
                                          "adamw8bit.vabs."};

}  // namespace

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
    f.bytes = u.value("bytes", false);
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
