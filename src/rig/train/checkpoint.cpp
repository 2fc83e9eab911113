#include "rig/train/checkpoint.h"

#include <xxhash.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>

#include "rig/core/allocator.h"
#include "rig/core/error.h"
#include "rig/io/atomic_file.h"
#include "rig/io/safetensors.h"

namespace rig {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

constexpr const char* kTensorsFile = "state.safetensors";
constexpr const char* kStateFile = "trainer_state.json";
constexpr const char* kManifestFile = "manifest.json";

std::string hex64(uint64_t h) { return fmt::format("{:016x}", h); }

// "step-123" -> 123; anything else (".step-123.tmp", "step-x") -> nullopt.
std::optional<int64_t> parse_step_name(const std::string& name) {
  if (name.rfind("step-", 0) != 0 || name.size() == 5) return std::nullopt;
  int64_t v = 0;
  const char* b = name.data() + 5;
  const char* e = name.data() + name.size();
  auto [p, ec] = std::from_chars(b, e, v);
  if (ec != std::errc() || p != e || v < 0) return std::nullopt;
  return v;
}

std::string iso_now() {
  auto t = std::chrono::system_clock::to_time_t(std::chrono::system_clock::now());
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

json read_json_file(const std::string& path) {
  std::string text = read_file(path);
  try {
    return json::parse(text);
  } catch (const json::exception& e) {
    bad_input("{}: not valid JSON: {}", path, e.what());
  }
}

// The cheap completeness check of list_checkpoints: manifest parses, names this step, and every
// file it lists is there at its recorded size.
bool looks_complete(const fs::path& dir, int64_t step) {
  std::error_code ec;
  if (!fs::is_regular_file(dir / kManifestFile, ec)) return false;
  try {
    json m = read_json_file((dir / kManifestFile).string());
    if (m.value("format", "") != kCheckpointFormat || m.value("step", int64_t(-1)) != step)
      return false;
    if (!m.contains("files") || !m["files"].is_object() || m["files"].empty()) return false;
    for (auto& [name, f] : m["files"].items()) {
      auto size = fs::file_size(dir / name, ec);
      if (ec || size != f.at("bytes").get<uint64_t>()) return false;
    }
    return true;
  } catch (const std::exception&) {
    return false;
  }
}

// Deleting a checkpoint: rename it out of the step-N namespace first, so a crash half-way through
// never leaves a step-N folder with files missing.
void remove_checkpoint_dir(const fs::path& dir) {
  fs::path doomed = dir.parent_path() / fmt::format(".{}.del", dir.filename().string());
  std::error_code ec;
  fs::remove_all(doomed, ec);
  fs::rename(dir, doomed, ec);
  fs::remove_all(ec ? dir : doomed, ec);
}

}  // namespace

std::string xxh3_hex(const void* data, size_t n) { return hex64(XXH3_64bits(data, n)); }

std::string xxh3_file_hex(const std::string& path) {
  std::unique_ptr<std::FILE, int (*)(std::FILE*)> f(std::fopen(path.c_str(), "rb"), std::fclose);
  if (!f) bad_input("{}: cannot open: {}", path, std::strerror(errno));
  std::unique_ptr<XXH3_state_t, XXH_errorcode (*)(XXH3_state_t*)> st(XXH3_createState(),
                                                                       XXH3_freeState);
  XXH3_64bits_reset(st.get());
  std::vector<char> buf(4 << 20);
  size_t n;
  while ((n = std::fread(buf.data(), 1, buf.size(), f.get())) > 0) XXH3_64bits_update(st.get(), buf.data(), n);
  if (std::ferror(f.get())) bad_input("{}: read failed: {}", path, std::strerror(errno));
  return hex64(XXH3_64bits_digest(st.get()));
}

bool is_float_dtype(DType d) {
  return d == DType::F32 || d == DType::F16 || d == DType::BF16 || d == DType::F64;
}

ValueStats value_stats(const Tensor& t) {
  ValueStats s;
  if (!is_float_dtype(t.dtype()) || t.numel() == 0) return s;
  Tensor c = t.device().is_cpu() ? t : t.to(Device::cpu(), "value_stats");
  auto visit = [&](double x, int64_t i) {
    if (std::isnan(x)) {
      if (s.nan++ == 0 && s.first_bad_at < 0) s.first_bad_at = i;
    } else if (std::isinf(x)) {
      if (s.inf++ == 0 && s.first_bad_at < 0) s.first_bad_at = i;
    } else if (std::fabs(x) > s.max_abs) {
      s.max_abs = std::fabs(x);
      s.max_abs_at = i;
    }
  };
  const int64_t n = c.numel();
  const uint8_t* base = static_cast<const uint8_t*>(c.raw());
  if (c.dtype() == DType::F64) {
    for (int64_t i = 0; i < n; ++i) {
      double x;
      std::memcpy(&x, base + 8 * i, 8);
      visit(x, i);
    }
    return s;
  }
  // Chunks converted to f32 keep memory flat for multi-gigabyte tensors (and unaligned views ok).
  constexpr int64_t kChunk = 1 << 16;
  std::vector<float> buf(size_t(std::min(n, kChunk)));
  size_t esize = dtype_size(c.dtype());
  for (int64_t b = 0; b < n; b += kChunk) {
    int64_t m = std::min(kChunk, n - b);
    if (c.dtype() == DType::F32)
      std::memcpy(buf.data(), base + esize * b, size_t(m) * 4);
    else
      convert_to_f32(c.dtype(), base + esize * b, buf.data(), size_t(m));
    for (int64_t i = 0; i < m; ++i) visit(buf[size_t(i)], b + i);
  }
  return s;
}

// ---- saving -------------------------------------------------------------------

namespace {

// The manifest's entry of every tensor in a safetensors file: name, dtype, shape, bytes, xxh3.
json tensor_entries(const std::string& tensors_path) {
  json tl = json::array();
  SafeTensorsFile f = SafeTensorsFile::open(tensors_path);
  for (const auto& info : f.tensors()) {
    Tensor v = f.get(info.name);
    tl.push_back({{"name", info.name},
                  {"dtype", std::string(dtype_name(info.dtype))},
                  {"shape", info.shape},
                  {"bytes", info.end - info.begin},
                  {"xxh3", xxh3_hex(v.raw(), info.end - info.begin)}});
  }
  return tl;
}

// Housekeeping after saving `step`: stale dot-folders of killed writers and deletions, then the
// oldest checkpoints beyond keep_last.
void prune_checkpoints(const std::string& run_dir, int64_t step, int64_t keep_last) {
  fs::path root = fs::path(run_dir) / "checkpoints";
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(root, ec)) {
    std::string n = e.path().filename().string();
    if (n.rfind(".step-", 0) == 0 && e.is_directory()) fs::remove_all(e.path(), ec);
  }
  if (keep_last > 0) {
    // Oldest first, never the one just written (after a rollback it may not be the newest).
    auto all = list_checkpoints(run_dir);
    size_t excess = all.size() > size_t(keep_last) ? all.size() - size_t(keep_last) : 0;
    for (size_t i = 0; i < all.size() && excess > 0; ++i) {
      if (all[i].step == step) continue;
      remove_checkpoint_dir(all[i].dir);
      --excess;
    }
    fsync_dir(root.string());
  }
}

}  // namespace

std::string save_checkpoint(const std::string& run_dir, int64_t step,
                            const std::vector<std::pair<std::string, Tensor>>& tensors,
                            const json& state, int64_t keep_last,
                            const std::vector<std::string>& extra_files,
                            const std::function<void()>& before_manifest) {
  if (step < 0) bad_input("save_checkpoint: step {} is negative", step);
  if (!state.is_object()) bad_input("save_checkpoint: the trainer state must be a JSON object");
  fs::path root = fs::path(run_dir) / "checkpoints";
  fs::path final_dir = root / fmt::format("step-{}", step);
  fs::path tmp = root / fmt::format(".step-{}.tmp", step);
  std::error_code ec;
  fs::create_directories(root, ec);
  if (ec) fail("{}: cannot create: {}", root.string(), ec.message());
  fs::remove_all(tmp, ec);
  fs::create_directory(tmp, ec);
  if (ec) fail("{}: cannot create: {}", tmp.string(), ec.message());

  std::string tensors_path = (tmp / kTensorsFile).string();
  save_safetensors(tensors_path, tensors,
                   {{"format", kCheckpointFormat}, {"step", std::to_string(step)}});

  json st = state;
  if (st.contains("step") && st["step"] != step)
    bad_input("save_checkpoint: state.step {} differs from step {}", st["step"].dump(), step);
  st["step"] = step;
  std::string st_text = st.dump(1) + "\n";
  write_file_atomic((tmp / kStateFile).string(), st_text);

  // Checksums are taken from what landed in the file, so they also cover the device-to-host copy.
  json m;
  m["format"] = kCheckpointFormat;
  m["step"] = step;
  m["created"] = iso_now();
  m["tensors"] = tensor_entries(tensors_path);
  m["files"] = json::object();
  std::vector<std::string> files = {kTensorsFile, kStateFile};
  for (const auto& f : extra_files) {
    std::string name = fs::path(f).filename().string();
    fs::rename(f, tmp / name, ec);
    if (ec) fail("{}: cannot move into {}: {}", f, tmp.string(), ec.message());
    files.push_back(name);
  }
  for (const auto& name : files) {
    std::string p = (tmp / name).string();
    m["files"][name] = {{"bytes", fs::file_size(p)}, {"xxh3", xxh3_file_hex(p)}};
  }
  if (before_manifest) before_manifest();
  write_file_atomic((tmp / kManifestFile).string(), m.dump(1) + "\n");
  fsync_dir(tmp.string());

  // Re-saving a step (after a rollback) swaps the old folder out first: rename cannot replace a
  // non-empty folder.
  if (fs::exists(final_dir)) {
    fs::path old = root / fmt::format(".step-{}.old", step);
    fs::remove_all(old, ec);
    fs::rename(final_dir, old, ec);
    if (ec) fail("{}: cannot move aside: {}", final_dir.string(), ec.message());
  }
  fs::rename(tmp, final_dir, ec);
  if (ec) fail("{}: cannot rename into place: {}", final_dir.string(), ec.message());
  fsync_dir(root.string());

  prune_checkpoints(run_dir, step, keep_last);
  return final_dir.string();
}

// ---- finding and loading ---------------------------------------------------------

std::vector<CheckpointRef> list_checkpoints(const std::string& run_dir) {
  std::vector<CheckpointRef> out;
  fs::path root = fs::path(run_dir) / "checkpoints";
  std::error_code ec;
  if (!fs::is_directory(root, ec)) return out;
  for (const auto& e : fs::directory_iterator(root, ec)) {
    auto step = parse_step_name(e.path().filename().string());
    if (!step || !e.is_directory()) continue;
    if (looks_complete(e.path(), *step)) out.push_back({*step, e.path().string()});
  }
  std::sort(out.begin(), out.end(),
            [](const CheckpointRef& a, const CheckpointRef& b) { return a.step < b.step; });
  return out;
}

std::optional<CheckpointRef> latest_checkpoint(const std::string& run_dir) {
  auto all = list_checkpoints(run_dir);
  if (all.empty()) return std::nullopt;
  return all.back();
}

const Tensor* LoadedCheckpoint::find(const std::string& name) const {
  for (const auto& [n, t] : tensors)
    if (n == name) return &t;
  return nullptr;
}

namespace {
LoadedCheckpoint load_checkpoint_unchecked(const std::string& dir) {
  fs::path d(dir);
  if (!fs::is_directory(d)) bad_input("{}: no such checkpoint folder", dir);
  std::string mpath = (d / kManifestFile).string();
  if (!fs::exists(mpath))
    bad_input("{}: no manifest.json: the checkpoint is incomplete (its writer was killed?)", dir);
  json m = read_json_file(mpath);
  if (m.value("format", "") != kCheckpointFormat)
    bad_input("{}: format is {}, expected \"{}\"", mpath, m.value("format", json()).dump(),
              kCheckpointFormat);
  LoadedCheckpoint out;
  out.dir = dir;
  out.step = m.at("step").get<int64_t>();

  std::string spath = (d / kStateFile).string();
  std::string st_text = read_file(spath);
  const json& fst = m.at("files").at(kStateFile);
  if (xxh3_hex(st_text.data(), st_text.size()) != fst.at("xxh3").get<std::string>())
    bad_input("{}: checksum does not match the manifest", spath);
  out.state = json::parse(st_text);

  std::string tpath = (d / kTensorsFile).string();
  SafeTensorsFile f = SafeTensorsFile::open(tpath);
  const json& tl = m.at("tensors");
  if (tl.size() != f.tensors().size())
    bad_input("{}: {} tensors, the manifest lists {}", tpath, f.tensors().size(), tl.size());
  for (const auto& e : tl) {
    std::string name = e.at("name");
    if (!f.has(name)) bad_input("{}: tensor '{}' of the manifest is missing", tpath, name);
    const TensorInfo& info = f.info(name);
    Tensor t = f.get(name);
    if (std::string(dtype_name(info.dtype)) != e.at("dtype").get<std::string>() ||
        info.shape != e.at("shape").get<Shape>())
      bad_input("{}: tensor '{}' is {} {}, the manifest says {} {}", tpath, name,
                dtype_name(info.dtype), shape_str(info.shape), e.at("dtype").get<std::string>(),
                e.at("shape").dump());
    if (xxh3_hex(t.raw(), info.end - info.begin) != e.at("xxh3").get<std::string>())
      bad_input("{}: tensor '{}': checksum does not match the manifest (corrupted on disk?)",
                tpath, name);
    out.tensors.emplace_back(name, t);
  }
  return out;
}
}  // namespace

LoadedCheckpoint load_checkpoint(const std::string& dir) {
  // A manifest (or trainer state) of the wrong shape is bad input like any other: one line
  // naming the folder, not a JSON library's internal error.
  try {
    return load_checkpoint_unchecked(dir);
  } catch (const json::exception& e) {
    bad_input("{}: manifest.json or trainer_state.json has an unexpected structure: {}", dir,
              e.what());
  }
}

// ---- verifying ----------------------------------------------------------------------

namespace {

// One verification under way: the folder, the options, and the report each check adds its
// problems to, in the order they are found.
struct Verification {
  fs::path d;
  const VerifyOptions& opt;
  VerifyReport r;
  void problem(std::string where, std::string what) {
    r.problems.push_back({std::move(where), std::move(what)});
  }
};

// The manifest: present, of this format, with files and tensors, and the folder's step. Sets
// r.manifest_ok; what it returns means something only then.
json check_manifest(Verification& v) {
  VerifyReport& r = v.r;
  json m;
  std::string mpath = (v.d / kManifestFile).string();
  if (!fs::exists(mpath)) {
    v.problem(kManifestFile,
              "missing: the checkpoint was never completed (its writer was killed?)");
  } else {
    try {
      m = read_json_file(mpath);
      if (!m.is_object() || m.value("format", "") != kCheckpointFormat)
        v.problem(kManifestFile, fmt::format("not a {} manifest", kCheckpointFormat));
      else if (!m.contains("files") || !m["files"].is_object() || !m.contains("tensors") ||
               !m["tensors"].is_array())
        v.problem(kManifestFile, "lacks 'files' or 'tensors'");
      else
        r.manifest_ok = true;
    } catch (const std::exception& e) {
      v.problem(kManifestFile, e.what());
    }
  }
  if (r.manifest_ok) {
    int64_t ms = m.value("step", int64_t(-1));
    if (r.step >= 0 && ms != r.step)
      v.problem(kManifestFile, fmt::format("step {} but the folder says {}", ms, r.step));
    r.step = ms;
  }
  return m;
}

// Files: present, sized and hashed as the manifest records.
void check_files(Verification& v, json& m) {
  for (auto& [name, f] : m["files"].items()) {
    fs::path p = v.d / name;
    std::error_code ec;
    if (!fs::exists(p)) {
      v.problem(name, "missing");
      continue;
    }
    uint64_t size = fs::file_size(p, ec);
    v.r.bytes += size;
    if (size != f.value("bytes", uint64_t(0))) {
      v.problem(name, fmt::format("{} bytes, the manifest says {} (truncated?)", size,
                                  f.value("bytes", uint64_t(0))));
      continue;
    }
    std::string h = xxh3_file_hex(p.string());
    if (h != f.value("xxh3", ""))
      v.problem(name, fmt::format("checksum {} does not match the manifest's {}", h,
                                  f.value("xxh3", "")));
  }
}

// The trainer state: a JSON object of the checkpoint's step.
void check_state(Verification& v) {
  fs::path sp = v.d / kStateFile;
  if (!fs::exists(sp)) {
    if (!v.r.manifest_ok) v.problem(kStateFile, "missing");
    return;
  }
  try {
    json st = read_json_file(sp.string());
    if (!st.is_object())
      v.problem(kStateFile, "is not a JSON object");
    else if (v.r.step >= 0 && st.value("step", int64_t(-1)) != v.r.step)
      v.problem(kStateFile, fmt::format("step {} but the checkpoint is step {}",
                                        st.value("step", json()).dump(), v.r.step));
  } catch (const std::exception& e) {
    v.problem(kStateFile, e.what());
  }
}

// NaN/Inf and implausible magnitudes in one float tensor.
void scan_values(Verification& v, const std::string& where, const std::string& name,
                 const Tensor& t) {
  ++v.r.tensors_scanned;
  ValueStats s = value_stats(t);
  if (!s.finite())
    v.problem(where, fmt::format("{} NaN and {} Inf of {} values (first at flat index {})", s.nan,
                                 s.inf, t.numel(), s.first_bad_at));
  double limit = v.opt.max_abs;
  for (const auto& [pat, lim] : v.opt.max_abs_for)
    if (name.find(pat) != std::string::npos) {
      limit = lim;
      break;
    }
  if (limit > 0 && s.max_abs > limit)
    v.problem(where, fmt::format("|x| = {:.4g} at flat index {} is above the plausible limit {:g}",
                                 s.max_abs, s.max_abs_at, limit));
}

// Other ranks' files (sharded checkpoints): their checksums are the manifest's file entries
// (check_files); their values are scanned here.
void scan_other_ranks(Verification& v, json& m) {
  for (auto& [name, fe] : m["files"].items()) {
    if (name == kTensorsFile || !name.ends_with(".safetensors") || !fs::exists(v.d / name))
      continue;
    try {
      SafeTensorsFile sf = SafeTensorsFile::open((v.d / name).string());
      for (const auto& info : sf.tensors()) {
        ++v.r.tensors;
        if (is_float_dtype(info.dtype))
          scan_values(v, fmt::format("tensor '{}' in {}", info.name, name), info.name,
                      sf.get(info.name));
      }
    } catch (const std::exception& e) {
      v.problem(name, e.what());
    }
  }
}

// This rank's tensors: each against its manifest entry, then its values.
void check_tensors(Verification& v, json& m, SafeTensorsFile& f) {
  std::map<std::string, json> listed;
  if (v.r.manifest_ok)
    for (const auto& e : m["tensors"]) listed[e.value("name", "")] = e;
  for (const auto& [name, e] : listed)
    if (!f.has(name))
      v.problem(fmt::format("tensor '{}'", name), "in the manifest but not in the file");
  v.r.tensors += f.tensors().size();
  for (const auto& info : f.tensors()) {
    std::string where = fmt::format("tensor '{}'", info.name);
    Tensor t = f.get(info.name);
    size_t nb = info.end - info.begin;
    if (v.r.manifest_ok) {
      auto it = listed.find(info.name);
      if (it == listed.end()) {
        v.problem(where, "not in the manifest");
      } else {
        const json& e = it->second;
        std::string h = xxh3_hex(t.raw(), nb);
        if (e.value("dtype", "") != dtype_name(info.dtype) ||
            e.value("shape", json()) != json(info.shape))
          v.problem(where, fmt::format("is {} {}, the manifest says {} {}", dtype_name(info.dtype),
                                       shape_str(info.shape), e.value("dtype", ""),
                                       e.value("shape", json()).dump()));
        else if (h != e.value("xxh3", ""))
          v.problem(where, fmt::format("checksum {} does not match the manifest's {} (corrupted "
                                       "bytes)",
                                       h, e.value("xxh3", "")));
      }
    }
    if (!v.opt.scan_values || !is_float_dtype(info.dtype)) continue;
    scan_values(v, where, info.name, t);
  }
}

VerifyReport verify_checkpoint_unchecked(const std::string& dir, const VerifyOptions& opt) {
  fs::path d(dir);
  if (!fs::is_directory(d)) bad_input("{}: no such checkpoint folder", dir);
  Verification v{d, opt, {}};
  v.r.dir = dir;
  if (auto s = parse_step_name(d.filename().string())) v.r.step = *s;
  json m = check_manifest(v);
  if (v.r.manifest_ok) check_files(v, m);
  check_state(v);
  fs::path tp = d / kTensorsFile;
  if (!fs::exists(tp)) {
    if (!v.r.manifest_ok) v.problem(kTensorsFile, "missing");
    return v.r;
  }
  std::optional<SafeTensorsFile> f;
  try {
    f = SafeTensorsFile::open(tp.string());
  } catch (const std::exception& e) {
    v.problem(kTensorsFile, e.what());
    return v.r;
  }
  if (v.r.manifest_ok && opt.scan_values) scan_other_ranks(v, m);
  check_tensors(v, m, *f);
  return v.r;
}

}  // namespace

VerifyReport verify_checkpoint(const std::string& dir, const VerifyOptions& opt) {
  // A manifest entry of an unexpected type (a size given as a string, ...) is one more problem
  // of the checkpoint, not an exception from the JSON library.
  try {
    return verify_checkpoint_unchecked(dir, opt);
  } catch (const json::exception& e) {
    VerifyReport r;
    r.dir = dir;
    if (auto s = parse_step_name(fs::path(dir).filename().string())) r.step = *s;
    r.problems.push_back({kManifestFile, fmt::format("unexpected structure: {}", e.what())});
    return r;
  }
}

std::string VerifyReport::to_text() const {
  std::string out;
  for (const auto& p : problems) out += fmt::format("  {}: {}\n", p.where, p.what);
  out += fmt::format("{}: {}: step {}, {} tensors ({} scanned for NaN/Inf and magnitude), {}\n",
                     dir, ok() ? "OK" : fmt::format("{} problem(s)", problems.size()), step,
                     tensors, tensors_scanned, format_bytes(double(bytes)));
  return out;
}

json VerifyReport::to_json() const {
  json p = json::array();
  for (const auto& x : problems) p.push_back({{"where", x.where}, {"what", x.what}});
  return {{"dir", dir},           {"ok", ok()},        {"step", step},
          {"manifest_ok", manifest_ok}, {"tensors", tensors}, {"tensors_scanned", tensors_scanned},
          {"bytes", bytes},       {"problems", p}};
}

}  // namespace rig
