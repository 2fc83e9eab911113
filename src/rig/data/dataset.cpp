#include "rig/data/dataset.h"

#include <xxhash.h>

#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "rig/core/error.h"
#include "rig/io/safetensors.h"
#include "rig/text/chat_template.h"

namespace rig {

namespace {

using json = nlohmann::json;
namespace fs = std::filesystem;

constexpr int kCacheVersion = 1;
const char* kCacheFile = "data.safetensors";

std::string file_xxh3(const std::string& path, uint64_t* size) {
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (!f) bad_input("{}: cannot open", path);
  XXH3_state_t* st = XXH3_createState();
  XXH3_64bits_reset(st);
  std::vector<char> buf(1 << 20);
  size_t n;
  *size = 0;
  while ((n = std::fread(buf.data(), 1, buf.size(), f)) > 0) {
    XXH3_64bits_update(st, buf.data(), n);
    *size += n;
  }
  std::fclose(f);
  uint64_t h = XXH3_64bits_digest(st);
  XXH3_freeState(st);
  return fmt::format("{:016x}", h);
}

json fingerprint_json(const PrepareOptions& opt) {
  DataFormat f = opt.render.format == DataFormat::Auto ? detect_data_format(opt.source) : opt.render.format;
  uint64_t size = 0;
  json j;
  j["version"] = kCacheVersion;
  j["source_xxh3"] = file_xxh3(opt.source, &size);
  j["source_bytes"] = size;
  j["format"] = data_format_name(f);
  j["chat_template"] = chat_template_name(opt.render.chat);
  j["train_on_all"] = opt.render.train_on_all;
  j["skip_invalid"] = opt.render.skip_invalid;
  if (f != DataFormat::Tokens) {
    if (opt.tokenizer.empty()) bad_input("{}: a tokenizer is needed for the {} format", opt.source, data_format_name(f));
    uint64_t tsize;
    j["tokenizer_xxh3"] = file_xxh3(opt.tokenizer, &tsize);
    // `auto` renders chat with the model's own template when one sits beside the tokenizer:
    // editing it must invalidate the cache (the key is absent otherwise, so older caches stay).
    fs::path dir = fs::path(opt.tokenizer).parent_path();
    if (f == DataFormat::Chat && opt.render.chat == ChatTemplate::Auto &&
        HfChatTemplate::find_in(dir.string())) {
      std::string h;
      for (const char* name : {"tokenizer_config.json", "chat_template.jinja"})
        if (fs::exists(dir / name)) h += file_xxh3((dir / name).string(), &tsize);
      j["chat_template_xxh3"] = h;
    }
  }
  return j;
}

}  // namespace

TokenDataset TokenDataset::from_samples(const std::vector<Sample>& samples) {
  TokenDataset d;
  size_t total = 0;
  for (const auto& s : samples) total += s.ids.size();
  d.tokens_ = Tensor::empty({int64_t(total)}, DType::I32, Device::cpu(), "dataset tokens");
  d.train_ = Tensor::empty({int64_t(total)}, DType::U8, Device::cpu(), "dataset train flags");
  d.offsets_t_ = Tensor::empty({int64_t(samples.size() + 1)}, DType::I64, Device::cpu(), "dataset offsets");
  int64_t* off = d.offsets_t_.data<int64_t>();
  size_t pos = 0;
  for (size_t i = 0; i < samples.size(); ++i) {
    RIG_CHECK(samples[i].train.size() == samples[i].ids.size(), "sample {}: ids and train flags differ in length", i);
    off[i] = int64_t(pos);
    std::copy(samples[i].ids.begin(), samples[i].ids.end(), d.tokens_.data<int32_t>() + pos);
    std::copy(samples[i].train.begin(), samples[i].train.end(), d.train_.data<uint8_t>() + pos);
    pos += samples[i].ids.size();
  }
  off[samples.size()] = int64_t(pos);
  d.tok_ = d.tokens_.data<int32_t>();
  d.trn_ = d.train_.data<uint8_t>();
  d.offsets_ = off;
  d.n_ = samples.size();
  return d;
}

TokenDataset TokenDataset::open(const std::string& dir) {
  std::string path = (fs::path(dir) / kCacheFile).string();
  if (!fs::exists(path)) bad_input("{}: no prepared dataset here (run `rig data prepare`)", path);
  auto f = SafeTensorsFile::open(path);
  for (const char* name : {"tokens", "train", "offsets"})
    if (!f.has(name)) bad_input("{}: tensor '{}' missing", path, name);
  TokenDataset d;
  d.tokens_ = f.get("tokens");
  d.train_ = f.get("train");
  d.offsets_t_ = f.get("offsets");
  if (d.tokens_.dtype() != DType::I32 || d.tokens_.ndim() != 1)
    bad_input("{}: tensor 'tokens': expected I32 [N], got {} {}", path, dtype_name(d.tokens_.dtype()), shape_str(d.tokens_.shape()));
  if (d.train_.dtype() != DType::U8 || d.train_.shape() != d.tokens_.shape())
    bad_input("{}: tensor 'train': expected U8 {}, got {} {}", path, shape_str(d.tokens_.shape()),
              dtype_name(d.train_.dtype()), shape_str(d.train_.shape()));
  if (d.offsets_t_.dtype() != DType::I64 || d.offsets_t_.ndim() != 1 || d.offsets_t_.dim(0) < 1)
    bad_input("{}: tensor 'offsets': expected I64 [n+1]", path);
  d.tok_ = d.tokens_.data<int32_t>();
  d.trn_ = d.train_.data<uint8_t>();
  d.offsets_ = d.offsets_t_.data<int64_t>();
  d.n_ = size_t(d.offsets_t_.dim(0) - 1);
  if (d.offsets_[0] != 0) bad_input("{}: tensor 'offsets': first entry is {}, expected 0", path, d.offsets_[0]);
  for (size_t i = 0; i < d.n_; ++i)
    if (d.offsets_[i + 1] < d.offsets_[i])
      bad_input("{}: tensor 'offsets': entry {} ({}) is below entry {} ({})", path, i + 1, d.offsets_[i + 1], i, d.offsets_[i]);
  if (d.offsets_[d.n_] != d.tokens_.dim(0))
    bad_input("{}: tensor 'offsets': last entry {} is not the token count {}", path, d.offsets_[d.n_], d.tokens_.dim(0));
  auto it = f.metadata().find("rig_data");
  if (it != f.metadata().end()) d.meta_ = it->second;
  return d;
}

std::span<const int32_t> TokenDataset::ids(size_t i) const {
  RIG_CHECK(i < n_, "sample {} out of range ({} samples)", i, n_);
  return {tok_ + offsets_[i], size_t(offsets_[i + 1] - offsets_[i])};
}

std::span<const uint8_t> TokenDataset::train(size_t i) const {
  RIG_CHECK(i < n_, "sample {} out of range ({} samples)", i, n_);
  return {trn_ + offsets_[i], size_t(offsets_[i + 1] - offsets_[i])};
}

std::string dataset_fingerprint(const PrepareOptions& opt) { return fingerprint_json(opt).dump(); }

// Keys of the fingerprint that differ between the cache and the current settings.
static std::string changed_keys(const json& cached, const json& now) {
  std::string out;
  for (auto it = now.begin(); it != now.end(); ++it)
    if (!cached.contains(it.key()) || cached[it.key()] != it.value())
      out += (out.empty() ? "" : ", ") + it.key();
  for (auto it = cached.begin(); it != cached.end(); ++it)
    if (!now.contains(it.key())) out += (out.empty() ? "" : ", ") + it.key();
  return out;
}

static json cached_fingerprint(const std::string& path) {
  auto f = SafeTensorsFile::open(path);
  auto it = f.metadata().find("rig_data");
  if (it == f.metadata().end()) return json();
  json m = json::parse(it->second, nullptr, false);
  return m.is_object() && m.contains("fingerprint") ? m["fingerprint"] : json();
}

PrepareResult prepare_dataset(const PrepareOptions& opt) {
  PrepareResult r;
  if (!fs::exists(opt.source)) bad_input("{}: no such file", opt.source);
  json fp = fingerprint_json(opt);
  r.path = (fs::path(opt.out_dir) / kCacheFile).string();
  if (fs::exists(r.path)) {
    json old = cached_fingerprint(r.path);
    if (!opt.force && old == fp) {
      TokenDataset d = TokenDataset::open(opt.out_dir);
      json meta = json::parse(d.metadata());
      const json& s = meta["stats"];
      r.stats.records = s.value("records", size_t(0));
      r.stats.samples = s.value("samples", size_t(0));
      r.stats.invalid = s.value("invalid", size_t(0));
      r.stats.tokens = s.value("tokens", uint64_t(0));
      r.stats.trained_tokens = s.value("trained_tokens", uint64_t(0));
      r.reason = "up to date";
      return r;
    }
    r.reason = opt.force ? "forced" : (old.is_null() ? "cache has no fingerprint" : changed_keys(old, fp) + " changed");
  } else {
    r.reason = "no cache";
  }
  std::unique_ptr<Tokenizer> tok;
  if (fp["format"] != "tokens") tok = std::make_unique<Tokenizer>(Tokenizer::load(opt.tokenizer));
  RenderOptions ro = opt.render;
  ro.format = parse_data_format(fp["format"].get<std::string>());
  auto samples = load_samples(opt.source, tok.get(), ro, &r.stats);
  TokenDataset d = TokenDataset::from_samples(samples);
  json meta;
  meta["fingerprint"] = fp;
  meta["source"] = fs::absolute(opt.source).string();
  meta["tokenizer"] = opt.tokenizer;
  if (!r.stats.chat_template.empty()) meta["chat_template"] = r.stats.chat_template;
  meta["stats"] = {{"records", r.stats.records}, {"samples", r.stats.samples}, {"invalid", r.stats.invalid},
                   {"tokens", r.stats.tokens}, {"trained_tokens", r.stats.trained_tokens}};
  fs::create_directories(opt.out_dir);
  save_safetensors(r.path, {{"tokens", d.tokens_tensor()}, {"train", d.train_tensor()}, {"offsets", d.offsets_tensor()}},
                   {{"rig_data", meta.dump()}});
  r.rebuilt = true;
  return r;
}

TokenDataset open_prepared(const PrepareOptions& opt) {
  std::string path = (fs::path(opt.out_dir) / kCacheFile).string();
  if (!fs::exists(path)) bad_input("{}: no prepared dataset (run `rig data prepare`)", path);
  json fp = fingerprint_json(opt);
  json old = cached_fingerprint(path);
  if (old != fp)
    bad_input("{}: stale dataset cache: {} since it was prepared; re-run `rig data prepare`", path,
              old.is_null() ? std::string("it has no fingerprint") : changed_keys(old, fp) + " changed");
  return TokenDataset::open(opt.out_dir);
}

}  // namespace rig
