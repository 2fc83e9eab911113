#include "rig/io/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "rig/core/allocator.h"
#include "rig/io/atomic_file.h"

namespace rig {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

// One tensor's header entry: dtype, shape and data_offsets, checked against the data buffer's
// size (the offsets' order and coverage are checked over all tensors afterwards).
TensorInfo parse_tensor_entry(const std::string& path, const std::string& name, const json& v,
                              size_t buffer) {
  auto where = [&](const char* what) {
    return fmt::format("{}: tensor '{}': {}", path, name, what);
  };
  if (!v.is_object()) bad_input("{}", where("entry is not an object"));
  TensorInfo t;
  t.name = name;
  if (!v.contains("dtype") || !v["dtype"].is_string()) bad_input("{}", where("missing dtype"));
  std::string dt = v["dtype"];
  if (!dtype_from_name(dt, &t.dtype) || t.dtype == DType::NF4)
    bad_input("{}: tensor '{}': unknown dtype '{}'", path, name, dt);
  if (!v.contains("shape") || !v["shape"].is_array()) bad_input("{}", where("missing shape"));
  int64_t numel = 1;
  for (auto& d : v["shape"]) {
    if (!d.is_number_integer() || d.get<int64_t>() < 0)
      bad_input("{}: tensor '{}': shape {} has a non-integer or negative dimension", path, name,
                v["shape"].dump());
    int64_t dim = d.get<int64_t>();
    if (dim && numel > (int64_t(1) << 50) / dim)
      bad_input("{}: tensor '{}': shape {} is too large", path, name, v["shape"].dump());
    numel *= dim;
    t.shape.push_back(dim);
  }
  const json off = v.contains("data_offsets") ? v["data_offsets"] : json();
  if (!off.is_array() || off.size() != 2 || !off[0].is_number_unsigned() ||
      !off[1].is_number_unsigned())
    bad_input("{}", where("data_offsets must be two non-negative integers"));
  t.begin = off[0].get<uint64_t>();
  t.end = off[1].get<uint64_t>();
  if (t.begin > t.end)
    bad_input("{}: tensor '{}': data_offsets [{}, {}] end before they begin", path, name, t.begin,
              t.end);
  if (t.end > buffer)
    bad_input("{}: tensor '{}': data_offsets [{}, {}] run past the end of the data ({} bytes)",
              path, name, t.begin, t.end, buffer);
  size_t want = dtype_nbytes(t.dtype, numel);
  if (t.end - t.begin != want)
    bad_input("{}: tensor '{}': {} {} needs {} bytes but data_offsets [{}, {}] hold {}", path, name,
              dt, shape_str(t.shape), want, t.begin, t.end, t.end - t.begin);
  return t;
}

}  // namespace

SafeTensorsHeader parse_safetensors_header(const uint8_t* data, size_t file_size,
                                           const std::string& path) {
  if (file_size < 8)
    bad_input("{}: file is {} bytes, shorter than the 8-byte header length", path, file_size);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | data[i];
  if (n > kMaxSafeTensorsHeader)
    bad_input("{}: header length {} is larger than the 100 MB limit", path, n);
  if (n > file_size - 8)
    bad_input("{}: header length {} runs past the end of the file ({} bytes)", path, n, file_size);
  SafeTensorsHeader h;
  h.data_start = 8 + size_t(n);
  const size_t buffer = file_size - h.data_start;
  json j;
  try {
    j = json::parse(data + 8, data + 8 + n);
  } catch (const json::exception& e) {
    // Not only syntax: a number too large for any integer type is out_of_range (found by fuzzing).
    bad_input("{}: header is not valid JSON: {}", path, e.what());
  }
  if (!j.is_object()) bad_input("{}: header must be a JSON object", path);
  for (auto& item : j.items()) {
    // Named copies rather than structured bindings: lambdas below capture them (clang 14).
    const std::string name = item.key();
    const json& v = item.value();
    if (name == "__metadata__") {
      if (!v.is_object()) bad_input("{}: __metadata__ must be an object of strings", path);
      for (auto& [k, s] : v.items()) {
        if (!s.is_string()) bad_input("{}: __metadata__ value '{}' is not a string", path, k);
        h.metadata[k] = s.get<std::string>();
      }
      continue;
    }
    h.tensors.push_back(parse_tensor_entry(path, name, v, buffer));
  }
  std::stable_sort(h.tensors.begin(), h.tensors.end(), [](const TensorInfo& a, const TensorInfo& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  size_t pos = 0;
  for (const auto& t : h.tensors) {
    if (t.begin < pos)
      bad_input("{}: tensor '{}': data_offsets [{}, {}] overlap the previous tensor (ending at {})",
                path, t.name, t.begin, t.end, pos);
    if (t.begin > pos)
      bad_input("{}: tensor '{}': data_offsets [{}, {}] leave a hole after byte {}", path, t.name,
                t.begin, t.end, pos);
    pos = t.end;
  }
  if (pos != buffer)
    bad_input("{}: tensors cover {} bytes but the data buffer holds {} (trailing bytes or truncation)",
              path, pos, buffer);
  return h;
}

SafeTensorsFile SafeTensorsFile::open(const std::string& path) {
  SafeTensorsFile f;
  f.path_ = path;
  int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0) bad_input("{}: cannot open: {}", path, std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    ::close(fd);
    bad_input("{}: cannot stat: {}", path, std::strerror(errno));
  }
  size_t size = size_t(st.st_size);
  void* p = nullptr;
  if (size > 0) {
    p = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
    if (p == MAP_FAILED) {
      ::close(fd);
      bad_input("{}: cannot map: {}", path, std::strerror(errno));
    }
  }
  ::close(fd);
  f.map_ = std::shared_ptr<void>(p, [size](void* q) {
    if (q) ::munmap(q, size);
  });
  f.base_ = static_cast<const uint8_t*>(p);
  static const uint8_t empty[8] = {};
  f.header_ = parse_safetensors_header(p ? f.base_ : empty, size, path);
  for (size_t i = 0; i < f.header_.tensors.size(); ++i) f.index_[f.header_.tensors[i].name] = i;
  return f;
}

const TensorInfo& SafeTensorsFile::info(const std::string& name) const {
  auto it = index_.find(name);
  if (it == index_.end()) bad_input("{}: no tensor named '{}'", path_, name);
  return header_.tensors[it->second];
}

Tensor SafeTensorsFile::get(const std::string& name) const {
  const TensorInfo& t = info(name);
  void* p = const_cast<uint8_t*>(base_ + header_.data_start + t.begin);
  Tensor v = Tensor::view(p, t.shape, t.dtype, Device::cpu(), map_);
  // The format packs tensors back to back, so one may start unaligned for its element type
  // (int64 after an odd number of bf16 values): reading it in place would be undefined.
  const size_t align = dtype_size(t.dtype);
  if (align > 1 && reinterpret_cast<uintptr_t>(p) % align) return v.clone(name);
  return v;
}

Tensor SafeTensorsFile::get_f32(const std::string& name) const {
  Tensor t = get(name);
  return t.dtype() == DType::F32 ? t : t.to_dtype(DType::F32);
}

namespace {
// The safetensors library's Dtype order (BOOL < U8 < I8 < I16 < F16 < BF16 < I32 < F32 < F64 <
// I64); files list the widest first.
int safetensors_rank(DType t) {
  switch (t) {
    case DType::BOOL:
      return 0;
    case DType::U8:
      return 1;
    case DType::I8:
      return 2;
    case DType::I16:
      return 3;
    case DType::F16:
      return 4;
    case DType::BF16:
      return 5;
    case DType::I32:
      return 6;
    case DType::F32:
      return 7;
    case DType::F64:
      return 8;
    case DType::I64:
      return 9;
    default:
      return -1;
  }
}
}  // namespace

void save_safetensors(const std::string& path,
                      const std::vector<std::pair<std::string, Tensor>>& tensors,
                      const std::map<std::string, std::string>& metadata, bool hf_order) {
  std::vector<size_t> order(tensors.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  if (hf_order)
    std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
      const int ra = safetensors_rank(tensors[a].second.dtype()),
                rb = safetensors_rank(tensors[b].second.dtype());
      return ra != rb ? ra > rb : tensors[a].first < tensors[b].first;
    });
  // The header: keys sorted by name, or (hf_order) __metadata__ first, then data order.
  json sorted = json::object();
  nlohmann::ordered_json ordered = nlohmann::ordered_json::object();
  if (!metadata.empty() && hf_order) ordered["__metadata__"] = metadata;
  if (!metadata.empty() && !hf_order) sorted["__metadata__"] = metadata;
  size_t off = 0;
  for (size_t i : order) {
    const auto& [name, t] = tensors[i];
    RIG_CHECK(name != "__metadata__", "{}: reserved tensor name", path);
    RIG_CHECK(!sorted.contains(name) && !ordered.contains(name), "{}: tensor '{}' written twice",
              path, name);
    size_t n = t.nbytes();
    if (hf_order) {
      ordered[name] = {{"dtype", std::string(dtype_name(t.dtype()))},
                       {"shape", t.shape()},
                       {"data_offsets", {off, off + n}}};
    } else {
      sorted[name] = {{"dtype", std::string(dtype_name(t.dtype()))},
                      {"shape", t.shape()},
                      {"data_offsets", {off, off + n}}};
    }
    off += n;
  }
  std::string hs = hf_order ? ordered.dump() : sorted.dump();
  hs.append((8 - hs.size() % 8) % 8, ' ');  // keep the data 8-byte aligned
  uint8_t len[8];
  uint64_t n = hs.size();
  for (int i = 0; i < 8; ++i) len[i] = uint8_t(n >> (8 * i));
  AtomicFile f(path);
  f.write(len, 8);
  f.write(hs);
  for (size_t i : order) {
    const auto& [name, t] = tensors[i];
    if (t.device().is_cpu()) {
      f.write(t.raw(), t.nbytes());
    } else {
      Tensor c = t.to(Device::cpu(), name);
      f.write(c.raw(), c.nbytes());
    }
  }
  f.commit();
}

WeightFiles WeightFiles::open_file(const std::string& path) {
  WeightFiles w;
  w.files_.push_back(SafeTensorsFile::open(path));
  for (const auto& t : w.files_[0].tensors()) w.where_[t.name] = 0;
  w.where_desc_ = path;
  return w;
}

WeightFiles WeightFiles::open_dir(const std::string& dir) {
  fs::path d(dir);
  if (fs::exists(d / "model.safetensors")) return open_file((d / "model.safetensors").string());
  fs::path index = d / "model.safetensors.index.json";
  if (!fs::exists(index))
    bad_input("{}: no model.safetensors or model.safetensors.index.json found", dir);
  json j;
  try {
    j = json::parse(read_file(index.string()));
  } catch (const json::exception& e) {
    bad_input("{}: not valid JSON: {}", index.string(), e.what());
  }
  if (!j.contains("weight_map") || !j["weight_map"].is_object())
    bad_input("{}: missing the 'weight_map' object", index.string());
  WeightFiles w;
  w.where_desc_ = dir;
  std::map<std::string, size_t> file_ids;
  for (auto& [name, file] : j["weight_map"].items()) {
    if (!file.is_string()) bad_input("{}: weight_map['{}'] is not a file name", index.string(), name);
    std::string fname = file;
    auto it = file_ids.find(fname);
    if (it == file_ids.end()) {
      w.files_.push_back(SafeTensorsFile::open((d / fname).string()));
      it = file_ids.emplace(fname, w.files_.size() - 1).first;
    }
    if (!w.files_[it->second].has(name))
      bad_input("{}: weight_map says '{}' is in {}, which does not hold it", index.string(), name,
                fname);
    w.where_[name] = it->second;
  }
  return w;
}

std::vector<std::string> WeightFiles::names() const {
  std::vector<std::string> out;
  for (const auto& f : files_)
    for (const auto& t : f.tensors())
      if (where_.count(t.name)) out.push_back(t.name);
  return out;
}

const TensorInfo& WeightFiles::info(const std::string& name) const {
  auto it = where_.find(name);
  if (it == where_.end()) bad_input("{}: no tensor named '{}'", where_desc_, name);
  return files_[it->second].info(name);
}

const std::string& WeightFiles::path_of(const std::string& name) const {
  auto it = where_.find(name);
  return it == where_.end() ? where_desc_ : files_[it->second].path();
}

Tensor WeightFiles::get(const std::string& name) const {
  info(name);
  return files_[where_.at(name)].get(name);
}

Tensor WeightFiles::get_f32(const std::string& name) const {
  info(name);
  return files_[where_.at(name)].get_f32(name);
}

}  // namespace rig
