#include "rig/train/guard.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>

#include "rig/core/error.h"
#include "rig/dist/communicator.h"
#include "rig/io/atomic_file.h"
#include "rig/train/train_config.h"

namespace rig {

namespace fs = std::filesystem;
using json = nlohmann::json;

// ---- fault injection -----------------------------------------------------------------------

namespace {

const std::vector<std::pair<FaultKind, std::string>>& kinds() {
  static const std::vector<std::pair<FaultKind, std::string>> k = {
      {FaultKind::NanGrad, "nan-grad"},
      {FaultKind::BitFlip, "bit-flip"},
      {FaultKind::BitFlipFrozen, "bit-flip-frozen"},
      {FaultKind::LossSpike, "loss-spike"},
      {FaultKind::Kill, "kill"},
      {FaultKind::KillDuringSave, "kill-during-save"},
      {FaultKind::CorruptCheckpoint, "corrupt-checkpoint"}};
  return k;
}

bool parse_int(std::string_view s, int64_t* out) {
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), *out);
  return !s.empty() && ec == std::errc() && p == s.data() + s.size();
}

// One element of a float tensor on any device, through a one-element host copy.
Tensor element(const Tensor& t, int64_t i) {
  return t.reshape({t.numel()}).slice_rows(i, i + 1);
}

float read_element(const Tensor& t, int64_t i) {
  Tensor h = element(t, i).to(Device::cpu(), "fault injection");
  if (h.dtype() == DType::F32) return h.f32()[0];
  float f;
  convert_to_f32(h.dtype(), h.raw(), &f, 1);
  return f;
}

}  // namespace

const char* fault_name(FaultKind k) {
  for (const auto& [kind, name] : kinds())
    if (kind == k) return name.c_str();
  return "?";
}

const std::vector<std::string>& fault_names() {
  static const std::vector<std::string> n = [] {
    std::vector<std::string> v;
    for (const auto& [kind, name] : kinds()) v.push_back(name);
    return v;
  }();
  return n;
}

Injection parse_injection(const std::string& spec, const std::string& where) {
  const std::string usage =
      "expected KIND@STEP or KIND@STEP:RANK, e.g. nan-grad@5 or bit-flip@40:1";
  auto at = spec.find('@');
  if (at == std::string::npos) bad_input("{}: '{}': {}", where, spec, usage);
  Injection inj;
  inj.spec = spec;
  const std::string kind = spec.substr(0, at);
  bool found = false;
  for (const auto& [k, name] : kinds())
    if (name == kind) {
      inj.kind = k;
      found = true;
    }
  if (!found) {
    std::string list;
    for (const auto& n : fault_names()) list += (list.empty() ? "" : ", ") + n;
    const std::string m = closest_match(kind, fault_names());
    bad_input("{}: '{}': '{}' is not a fault rig injects ({}){}", where, spec, kind, list,
              m.empty() ? "" : fmt::format("; did you mean '{}'?", m));
  }
  std::string rest = spec.substr(at + 1), step = rest, rank;
  if (auto colon = rest.find(':'); colon != std::string::npos) {
    step = rest.substr(0, colon);
    rank = rest.substr(colon + 1);
  }
  int64_t v = 0;
  if (!parse_int(step, &v) || v < 1)
    bad_input(
        "{}: '{}': the step must be a whole number from 1 (the optimizer step the fault "
        "hits), found '{}'",
        where, spec, step);
  inj.step = v;
  if (!rank.empty() || spec.back() == ':') {
    if (!parse_int(rank, &v) || v < 0)
      bad_input("{}: '{}': the rank must be a whole number from 0, found '{}'", where, spec, rank);
    inj.rank = int(v);
  }
  return inj;
}

Injector::Injector(const std::vector<std::string>& specs, int world, const std::string& where) {
  for (const auto& s : specs) {
    Injection i = parse_injection(s, where);
    if (i.rank >= world)
      bad_input("{}: '{}' aims at rank {}, but this run has {} rank(s)", where, s, i.rank, world);
    all_.push_back(i);
  }
}

std::optional<Injection> Injector::take(FaultKind kind, int64_t step, bool at_or_after) {
  for (auto& i : all_) {
    if (i.fired || i.kind != kind) continue;
    if (at_or_after ? i.step > step : i.step != step) continue;
    i.fired = true;
    return i;
  }
  return std::nullopt;
}

void poison_first_element(const std::vector<Tensor>& grads) {
  for (const Tensor& g : grads) {
    if (!g.defined() || g.numel() == 0) continue;
    Tensor h = Tensor::empty({1}, g.dtype(), Device::cpu(), "fault injection");
    const float nan = std::nanf("");
    convert_from_f32(g.dtype(), &nan, h.raw(), 1);
    element(g, 0).copy_from(h);
    return;
  }
}

std::pair<float, float> flip_high_exponent_bit(Tensor& t) {
  if (t.dtype() == DType::U8) {
    const int64_t i = t.numel() / 2;
    Tensor h = t.reshape({t.numel()}).slice_rows(i, i + 1).to(Device::cpu(), "fault injection");
    const uint8_t before = h.data<uint8_t>()[0];
    h.data<uint8_t>()[0] = uint8_t(before ^ 0x80u);
    t.reshape({t.numel()}).slice_rows(i, i + 1).copy_from(h);
    return {float(before), float(before ^ 0x80u)};
  }
  RIG_CHECK(t.dtype() == DType::F32 || t.dtype() == DType::BF16,
            "bit-flip: a {} tensor has no float exponent", dtype_name(t.dtype()));
  const int64_t i = t.numel() / 2;
  const float before = read_element(t, i);
  Tensor h = element(t, i).to(Device::cpu(), "fault injection");
  if (h.dtype() == DType::F32) {
    uint32_t u;
    std::memcpy(&u, h.raw(), 4);
    u ^= 1u << 30;
    std::memcpy(h.raw(), &u, 4);
  } else {
    uint16_t u;
    std::memcpy(&u, h.raw(), 2);
    u ^= uint16_t(1u << 14);
    std::memcpy(h.raw(), &u, 2);
  }
  element(t, i).copy_from(h);
  return {before, read_element(t, i)};
}

std::string corrupt_checkpoint_file(const std::string& ckpt_dir) {
  std::string target;
  uintmax_t best = 0;
  for (const auto& e : fs::directory_iterator(ckpt_dir)) {
    if (e.path().extension() != ".safetensors") continue;
    if (e.file_size() > best || target.empty()) {
      best = e.file_size();
      target = e.path().string();
    }
  }
  if (target.empty()) fail("{}: no .safetensors file to corrupt", ckpt_dir);
  // Past the header: the last quarter of the file is tensor data.
  std::fstream f(target, std::ios::in | std::ios::out | std::ios::binary);
  const std::streamoff at = std::streamoff(best - best / 4);
  char b[8] = {};
  f.seekg(at);
  f.read(b, sizeof b);
  for (char& c : b) c = char(~c);
  f.seekp(at);
  f.write(b, sizeof b);
  f.close();
  if (!f) fail("{}: could not corrupt it", target);
  return target;
}

// ---- the spike rule ------------------------------------------------------------------------

double median_of(std::vector<double> v) {
  if (v.empty()) return 0;
  const size_t n = v.size(), mid = n / 2;
  std::nth_element(v.begin(), v.begin() + long(mid), v.end());
  const double hi = v[mid];
  if (n % 2) return hi;
  const double lo = *std::max_element(v.begin(), v.begin() + long(mid));
  return 0.5 * (lo + hi);
}

double mad_of(const std::vector<double>& v, double median) {
  std::vector<double> d;
  d.reserve(v.size());
  for (double x : v) d.push_back(std::fabs(x - median));
  return median_of(std::move(d));
}

json Spike::to_json() const {
  return {{"rule", metric},
          {"value", value},
          {"median", median},
          {"mad", mad},
          {"threshold", threshold}};
}

std::optional<Spike> SpikeDetector::check_one(const char* metric, const std::deque<double>& h,
                                              double x, double ratio) const {
  if (int64_t(h.size()) < rule_.warmup) return std::nullopt;
  std::vector<double> v(h.begin(), h.end());
  const double m = median_of(v), mad = mad_of(v, m);
  const double threshold = std::max(m + rule_.k * 1.4826 * mad, ratio * m);
  if (!(x > threshold)) return std::nullopt;
  return Spike{metric, x, m, mad, threshold};
}

std::optional<Spike> SpikeDetector::check(double loss, double grad_norm) const {
  if (auto s = check_one("loss", loss_, loss, rule_.loss_ratio)) return s;
  return check_one("grad_norm", grad_, grad_norm, rule_.grad_ratio);
}

void SpikeDetector::record(double loss, double grad_norm) {
  loss_.push_back(loss);
  grad_.push_back(grad_norm);
  while (int64_t(loss_.size()) > rule_.window) loss_.pop_front();
  while (int64_t(grad_.size()) > rule_.window) grad_.pop_front();
}

json SpikeDetector::to_json() const {
  return {{"loss", std::vector<double>(loss_.begin(), loss_.end())},
          {"grad_norm", std::vector<double>(grad_.begin(), grad_.end())}};
}

void SpikeDetector::from_json(const json& j) {
  loss_.clear();
  grad_.clear();
  if (!j.is_object()) return;
  for (const auto& x : j.value("loss", json::array())) loss_.push_back(x.get<double>());
  for (const auto& x : j.value("grad_norm", json::array())) grad_.push_back(x.get<double>());
  while (int64_t(loss_.size()) > rule_.window) loss_.pop_front();
  while (int64_t(grad_.size()) > rule_.window) grad_.pop_front();
}

// ---- replica and weight health ---------------------------------------------------------------

std::vector<RankHealth> gather_health(dist::Communicator* comm, const RankHealth& mine) {
  if (!comm) return {mine};
  // Float32 collectives carry 16-bit pieces exactly: 4 for the hash, 3 for the count, 1 flag.
  constexpr int kFields = 8;
  Tensor in = Tensor::zeros({kFields}, DType::F32, Device::cpu(), "health");
  float* f = in.f32();
  for (int k = 0; k < 4; ++k) f[k] = float((mine.hash >> (16 * k)) & 0xFFFF);
  const uint64_t bad = uint64_t(std::min<int64_t>(mine.implausible, (int64_t(1) << 47)));
  for (int k = 0; k < 3; ++k) f[4 + k] = float((bad >> (16 * k)) & 0xFFFF);
  f[7] = mine.changed ? 1.0f : 0.0f;
  const int world = comm->world();
  Tensor out = Tensor::empty({kFields * world}, DType::F32, Device::cpu(), "health");
  if (comm->device().is_cpu()) {
    comm->all_gather(in, out);
  } else {
    Tensor d = Tensor::empty({kFields * world}, DType::F32, comm->device(), "health");
    comm->all_gather(in.to(comm->device(), "health"), d);
    out = d.to(Device::cpu(), "health");
  }
  std::vector<RankHealth> all(static_cast<size_t>(world));
  for (int r = 0; r < world; ++r) {
    const float* g = out.f32() + kFields * r;
    RankHealth& h = all[size_t(r)];
    for (int k = 0; k < 4; ++k) h.hash |= uint64_t(std::llround(g[k])) << (16 * k);
    uint64_t b = 0;
    for (int k = 0; k < 3; ++k) b |= uint64_t(std::llround(g[4 + k])) << (16 * k);
    h.implausible = int64_t(b);
    h.changed = g[7] > 0.5f;
  }
  return all;
}

HealthVerdict judge_health(const std::vector<RankHealth>& all, bool compare_hashes,
                           const std::string& changed_rule) {
  HealthVerdict v;
  const int world = int(all.size());
  auto ranks_where = [&](auto pred) {
    std::vector<int> r;
    for (int i = 0; i < world; ++i)
      if (pred(all[size_t(i)])) r.push_back(i);
    return r;
  };
  auto list = [](const std::vector<int>& r) {
    std::string s;
    for (size_t i = 0; i < r.size(); ++i)
      s += (i == 0 ? "" : i + 1 == r.size() ? " and " : ", ") + std::to_string(r[i]);
    return s;
  };
  std::map<uint64_t, int> votes;
  for (const auto& h : all) ++votes[h.hash];
  const bool hashes_differ = compare_hashes && votes.size() > 1;
  const auto implausible = ranks_where([](const RankHealth& h) { return h.implausible > 0; });
  const auto changed = ranks_where([](const RankHealth& h) { return h.changed; });
  if (!hashes_differ && implausible.empty() && changed.empty()) return v;
  v.ok = false;
  if (hashes_differ) {
    v.rule = "replica";
    for (const auto& h : all) v.hashes.push_back(h.hash);
    int best = 0;
    uint64_t majority = 0;
    bool tie = false;
    for (const auto& [h, n] : votes) {
      if (n > best) {
        best = n;
        majority = h;
        tie = false;
      } else if (n == best) {
        tie = true;
      }
    }
    if (!implausible.empty()) {
      v.ranks = implausible;
      v.detail = fmt::format(
          "the parameters of rank(s) {} differ from the other replicas and hold "
          "implausible values",
          list(v.ranks));
    } else if (!changed.empty()) {
      v.ranks = changed;
      v.detail = fmt::format(
          "the parameters of rank(s) {} differ from the other replicas: weights "
          "that nothing writes changed there",
          list(v.ranks));
    } else if (!tie) {
      v.ranks = ranks_where([&](const RankHealth& h) { return h.hash != majority; });
      v.detail = fmt::format("the parameters of rank(s) {} differ from the other {} replicas",
                             list(v.ranks), best);
    } else {
      for (int i = 0; i < world; ++i) v.ranks.push_back(i);
      v.detail = fmt::format(
          "the replicas of ranks {} hold {} different parameter sets and none "
          "is the majority, so the odd one cannot be told",
          list(v.ranks), votes.size());
    }
  } else if (!changed.empty()) {
    v.rule = changed_rule;
    v.ranks = changed;
    v.detail =
        fmt::format("the {} of rank(s) {} changed while nothing wrote them",
                    changed_rule == "shard" ? "parameter shards" : "frozen weights", list(v.ranks));
  } else {
    v.rule = "weights";
    v.ranks = implausible;
    int64_t n = 0;
    for (int r : implausible) n += all[size_t(r)].implausible;
    v.detail = fmt::format("{} weight(s) on rank(s) {} are NaN, Inf or above {:g} in magnitude", n,
                           list(v.ranks), kImplausibleWeight);
  }
  return v;
}

// ---- checkpoints fit for use ---------------------------------------------------------------

VerifyOptions verify_for_use() {
  VerifyOptions o;
  o.max_abs = 0;  // optimizer moments may be large; NaN/Inf are still rejected everywhere
  o.max_abs_for = {{"param.", kImplausibleWeight}};
  return o;
}

CheckpointChoice newest_usable_checkpoint(const std::string& run_dir, bool verify) {
  CheckpointChoice c;
  auto all = list_checkpoints(run_dir);
  for (auto it = all.rbegin(); it != all.rend(); ++it) {
    if (!verify) {
      c.chosen = *it;
      break;
    }
    VerifyReport r;
    try {
      r = verify_checkpoint(it->dir, verify_for_use());
    } catch (const std::exception& e) {
      r.problems.push_back({it->dir, e.what()});
    }
    if (r.ok()) {
      c.chosen = *it;
      break;
    }
    RejectedCheckpoint rej{it->step, it->dir, {}};
    for (const auto& p : r.problems) rej.problems.push_back(p.where + ": " + p.what);
    if (rej.problems.empty()) rej.problems.push_back("the manifest is not valid");
    c.rejected.push_back(std::move(rej));
  }
  return c;
}

std::string set_aside_checkpoint(const std::string& dir) {
  fs::path d(dir);
  fs::path to = d.parent_path() / ("rejected-" + d.filename().string());
  std::error_code ec;
  fs::remove_all(to, ec);
  fs::rename(d, to, ec);
  if (ec) fail("{}: cannot set the rejected checkpoint aside: {}", dir, ec.message());
  fsync_dir(d.parent_path().string());
  return to.string();
}

}  // namespace rig
