#include "rig/model/llama.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <random>

#include "rig/io/atomic_file.h"
#include "rig/io/safetensors.h"
#include "rig/model/llama_parts.h"
#include "rig/ops/ops.h"
#include "rig/quant/random_codes.h"

namespace rig {

namespace fs = std::filesystem;
using namespace llama_detail;

LlamaModel::LlamaModel() = default;
LlamaModel::~LlamaModel() = default;

std::vector<double> rope_inv_freq(const ModelConfig& cfg) {
  const int64_t d = cfg.head_dim;
  std::vector<double> inv(size_t(d / 2));
  for (int64_t i = 0; i < d / 2; ++i) {
    // transformers computes base ** (2i/d) in float32; do the same before widening.
    float e = float(2 * i) / float(d);
    inv[size_t(i)] = double(1.0f / std::pow(float(cfg.rope.theta), e));
  }
  if (cfg.rope.type == "llama3") {
    const double factor = cfg.rope.factor, lo = cfg.rope.low_freq_factor,
                 hi = cfg.rope.high_freq_factor;
    const double old_ctx = double(cfg.rope.original_max_position_embeddings);
    const double low_wavelen = old_ctx / lo, high_wavelen = old_ctx / hi;
    for (auto& f : inv) {
      float ff = float(f);
      double wavelen = 2 * M_PI / ff;
      double scaled = wavelen > low_wavelen ? ff / factor : ff;
      if (!(wavelen < high_wavelen) && !(wavelen > low_wavelen)) {
        double smooth = (old_ctx / wavelen - lo) / (hi - lo);
        scaled = (1 - smooth) * scaled / factor + smooth * scaled;
      }
      f = double(float(scaled));
    }
  }
  return inv;
}

void LlamaModel::register_param(const std::string& name, Tensor t, bool no_decay, bool compute_operand) {
  Param p;
  p.name = name;
  p.value = std::move(t);
  p.no_decay = no_decay;
  p.compute_operand = compute_operand;
  params_.push_back(std::move(p));
}

void LlamaModel::bind_outer() {
  embed_ = params_.front().operand();
  final_norm_ = find_param("model.norm.weight")->value;
  lm_head_ = cfg_.tie_word_embeddings ? embed_ : find_param("lm_head.weight")->operand();
}

Tensor LlamaModel::act(const Shape& s, const char* what) const { return Tensor::empty(s, act_, dev_, what); }

Tensor LlamaModel::to_act(const Tensor& x) const {
  if (x.dtype() == act_) return x;
  Tensor y = Tensor::empty(x.shape(), act_, x.device(), "activation copy");
  ops::cast(x, y);
  return y;
}

void LlamaModel::set_compute_dtype(DType dt) {
  if (dt == act_) return;
  RIG_CHECK(dt == DType::F32 || dt == DType::BF16, "compute dtype must be F32 or BF16, not {}", dtype_name(dt));
  for (auto& p : params_) {
    if (!p.compute_operand) continue;
    p.compute = Tensor();
    if (p.value.dtype() == dt) continue;  // a frozen matrix already stored in `dt`
    Tensor c = Tensor::empty(p.value.shape(), dt, dev_, "weight");
    ops::cast(p.value, c);
    if (p.trainable && dt == DType::BF16) {
      p.compute = c;  // the float32 master stays in `value`
    } else {
      p.value = c;  // frozen: stored in the compute dtype itself
    }
  }
  act_ = dt;
  bind_outer();
}

void LlamaModel::refresh_compute_weights() {
  for (auto& p : params_)
    if (p.compute.defined()) ops::cast(p.value, p.compute);
}

void LlamaModel::build(const ModelConfig& cfg,
                       const std::function<bool(const std::string&)>& four_bit) {
  cfg_ = cfg;
  const int64_t h = cfg.hidden_size, f = cfg.intermediate_size;
  static const char* names[7] = {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                 "self_attn.o_proj", "mlp.gate_proj",    "mlp.up_proj",
                                 "mlp.down_proj"};
  const int64_t out[7] = {cfg.q_dim(), cfg.kv_dim(), cfg.kv_dim(), h, f, f, h};
  const int64_t in[7] = {h, h, h, cfg.q_dim(), h, h, f};
  const bool bias[7] = {cfg.qkv_bias, cfg.qkv_bias, cfg.qkv_bias, cfg.o_bias,
                        cfg.mlp_bias, cfg.mlp_bias, cfg.mlp_bias};
  register_param("model.embed_tokens.weight", fresh({cfg.vocab_size, h}, "embed_tokens"), false, true);
  for (int64_t l = 0; l < cfg.num_layers; ++l) {
    auto L = std::make_unique<Layer>();
    std::string pre = fmt::format("model.layers.{}.", l);
    for (int p = 0; p < 7; ++p) {
      Linear& lin = L->proj[p];
      lin.module = pre + names[p];
      lin.w = int(params_.size());
      const std::string wname = lin.module + ".weight";
      if (four_bit && four_bit(wname)) {
        register_param(wname, Tensor(), false, false);
        Param& qp = params_.back();
        qp.trainable = false;
        qp.quant = std::make_shared<quant::QuantizedWeight>();
        qp.quant->shape = {out[p], in[p]};
      } else {
        register_param(wname, fresh({out[p], in[p]}, names[p]), false, true);
      }
      if (bias[p]) {
        lin.b = int(params_.size());
        register_param(lin.module + ".bias", fresh({out[p]}, names[p]), true, true);
      }
    }
    if (cfg.qk_norm) {
      L->q_norm = int(params_.size());
      register_param(pre + "self_attn.q_norm.weight", fresh({cfg.head_dim}, "norm"), true, false);
      L->k_norm = int(params_.size());
      register_param(pre + "self_attn.k_norm.weight", fresh({cfg.head_dim}, "norm"), true, false);
    }
    L->in_norm = int(params_.size());
    register_param(pre + "input_layernorm.weight", fresh({h}, "norm"), true, false);
    L->post_norm = int(params_.size());
    register_param(pre + "post_attention_layernorm.weight", fresh({h}, "norm"), true, false);
    layers_.push_back(std::move(L));
  }
  register_param("model.norm.weight", fresh({h}, "norm"), true, false);
  if (!cfg.tie_word_embeddings)
    register_param("lm_head.weight", fresh({cfg.vocab_size, h}, "lm_head"), false, true);
  bind_outer();
}

void LlamaModel::to_device(Device dev) {
  if (dev == dev_) return;
  qbuf_ = qview_ = Tensor();
  for (auto& p : params_) {
    if (p.quant) *p.quant = p.quant->to(dev);
    if (p.value.defined()) p.value = p.value.to(dev, "parameter");
    if (p.compute.defined()) p.compute = p.compute.to(dev, "bf16 weight");
    if (p.grad.defined()) p.grad = p.grad.to(dev, "gradient");
  }
  dev_ = dev;
  bind_outer();
  rope_cos_ = rope_sin_ = Tensor();
}

Param* LlamaModel::find_param(const std::string& name) {
  for (auto& p : params_)
    if (p.name == name) return &p;
  return nullptr;
}

namespace {
// A float weight of the folder quantized as bitsandbytes' quantize_4bit does (float64 first read
// as float32): one float tensor in memory at a time.
quant::QuantizedWeight quantize_stored(const WeightFiles& w, const std::string& name,
                                       quant::QuantType type, int64_t blocksize,
                                       bool double_quant) {
  Tensor src = w.get(name);
  if (src.dtype() == DType::F64) src = src.to_dtype(DType::F32);
  return quant::quantize_4bit(src, type, blocksize, double_quant);
}
}  // namespace

std::unique_ptr<LlamaModel> LlamaModel::load(const std::string& dir, const LoadOptions& opt) {
  ModelConfig cfg = ModelConfig::load(dir);
  const auto qcfg =
      quant::parse_quantization_config(cfg.raw, (fs::path(dir) / "config.json").string());
  auto files = std::make_shared<WeightFiles>(WeightFiles::open_dir(dir));
  const WeightFiles& w = *files;
  std::unique_ptr<LlamaModel> m(new LlamaModel());
  // Linear weights stay (or become) 4-bit unless asked for float32.
  m->build(cfg, [&](const std::string& name) {
    return !opt.dequantize && (opt.quantize || quant::is_quantized(w, name));
  });
  for (auto& p : m->params_) {
    if (!w.has(p.name)) bad_input("{}: weights have no tensor '{}' required by config.json", dir, p.name);
    const bool stored_4bit = quant::is_quantized(w, p.name);
    if (stored_4bit && p.quant && opt.defer_quantize) {
      *p.quant = quant::load_quantized(w, p.name, p.shape(), /*tensors=*/false);
      m->codes_deferred_ = true;
      m->deferred_files_ = files;
      continue;
    }
    if (stored_4bit) {
      // transformers' layout: the packed weight and its companions, checked against the shape.
      quant::QuantizedWeight q = quant::load_quantized(w, p.name, p.shape());
      if (p.quant) {
        *p.quant = std::move(q);
      } else {
        quant::dequantize_4bit(q, p.value);  // as bitsandbytes decodes it (rounded to its dtype)
      }
      continue;
    }
    const TensorInfo& info = w.info(p.name);
    if (info.dtype != DType::F32 && info.dtype != DType::BF16 && info.dtype != DType::F16 &&
        info.dtype != DType::F64)
      bad_input("{}: tensor '{}' is {} {}, not a float weight{}", w.path_of(p.name), p.name,
                dtype_name(info.dtype), shape_str(info.shape),
                info.dtype == DType::U8
                    ? fmt::format(" (a bitsandbytes 4-bit weight needs '{}.{}' beside it)", p.name,
                                  quant::quant_state_suffix(quant::QuantType::NF4))
                    : "");
    if (info.shape != p.shape())
      bad_input("{}: tensor '{}' has shape {} but config.json implies {}", w.path_of(p.name),
                p.name, shape_str(info.shape), shape_str(p.shape()));
    if (p.quant && opt.defer_quantize) {
      // Its scalars now (the offset once quantized), its tensors on demand.
      *p.quant = quant::drawn_4bit_skeleton(p.shape(), opt.quant_type, opt.blocksize,
                                            opt.double_quant);
      p.quant->dtype = info.dtype == DType::F64 ? DType::F32 : info.dtype;
      m->codes_deferred_ = m->offsets_pending_ = true;
      m->deferred_files_ = files;
      continue;
    }
    if (p.quant) {
      *p.quant = quantize_stored(w, p.name, opt.quant_type, opt.blocksize, opt.double_quant);
      continue;
    }
    if (opt.frozen_bf16 && p.compute_operand && info.dtype == DType::BF16) {
      p.value = w.get(p.name).clone("weight");  // what set_compute_dtype(BF16) would make
      continue;
    }
    p.value.copy_from(w.get_f32(p.name));
  }
  if (m->is_quantized()) {
    if (qcfg) {
      m->qcfg_ = *qcfg;
    } else {
      quant::QuantConfig qc;
      qc.type = opt.quant_type;
      qc.blocksize = opt.blocksize;
      qc.double_quant = opt.double_quant;
      m->qcfg_ = qc;
    }
  }
  return m;
}

std::unique_ptr<LlamaModel> LlamaModel::random(const ModelConfig& cfg, uint64_t seed,
                                               const LoadOptions& opt) {
  std::unique_ptr<LlamaModel> m(new LlamaModel());
  // Linear weights to quantize are registered 4-bit: no float32 storage for the whole model.
  m->build(cfg, [&](const std::string&) { return opt.quantize; });
  // Chunks with their own seeds: the same weights for any thread count, and fast enough for
  // 8B-parameter shapes.
  constexpr int64_t kChunk = int64_t(1) << 16;
  for (size_t pi = 0; pi < m->params_.size(); ++pi) {
    Param& p = m->params_[pi];
    const bool quantize = bool(p.quant);
    if (quantize && opt.draw_codes) {
      *p.quant = quant::drawn_4bit_skeleton(p.quant->shape, opt.quant_type, opt.blocksize,
                                            opt.double_quant);
      m->codes_deferred_ = true;
      continue;
    }
    // A weight to quantize is drawn into a temporary and replaced by its 4-bit form at once.
    Tensor drawn =
        quantize ? Tensor::empty(p.shape(), DType::F32, Device::cpu(), "weight") : p.value;
    float* x = drawn.f32();
    const int64_t n = drawn.numel();
    const bool is_norm = p.name.find("norm") != std::string::npos;
    const bool is_bias = p.name.size() > 5 && p.name.compare(p.name.size() - 5, 5, ".bias") == 0;
    if (is_norm || is_bias) {
      std::fill(x, x + n, is_norm ? 1.0f : 0.0f);
      continue;
    }
    const int64_t chunks = (n + kChunk - 1) / kChunk;
#pragma omp parallel for schedule(dynamic, 4)
    for (int64_t c = 0; c < chunks; ++c) {
      std::mt19937_64 rng(mix_seed(seed, int(pi), int(c)));
      std::normal_distribution<float> normal(0.0f, 0.02f);
      for (int64_t i = c * kChunk; i < std::min(n, (c + 1) * kChunk); ++i) x[i] = normal(rng);
    }
    if (quantize)
      *p.quant = quant::quantize_4bit(drawn, opt.quant_type, opt.blocksize, opt.double_quant);
  }
  m->codes_seed_ = seed;
  if (opt.quantize) {
    quant::QuantConfig qc;
    qc.type = opt.quant_type;
    qc.blocksize = opt.blocksize;
    qc.double_quant = opt.double_quant;
    m->qcfg_ = qc;
  }
  return m;
}

const quant::QuantizedWeight& LlamaModel::quantize_deferred(size_t param) {
  if (cached_param_ != param) {
    Param& p = params_[param];
    cached_param_ = SIZE_MAX;
    if (quant::is_quantized(*deferred_files_, p.name)) {
      cached_ = quant::load_quantized(*deferred_files_, p.name, p.shape());
    } else {
      cached_ = quantize_stored(*deferred_files_, p.name, p.quant->type, p.quant->blocksize,
                                p.quant->nested);
    }
    cached_param_ = param;
    ++deferred_quantized_;
    p.quant->nested_offset = cached_.nested_offset;
  }
  return cached_;
}

void LlamaModel::deferred_4bit_bytes(size_t param, Tensor quant::QuantizedWeight::*field,
                                     int64_t begin, int64_t end, uint8_t* out) {
  RIG_CHECK(codes_deferred_ && params_.at(param).quant, "parameter {} has no deferred 4-bit weight",
            param);
  if (!deferred_files_) {
    quant::draw_4bit_bytes(*params_[param].quant, mix_seed(codes_seed_, int(param), -1), field,
                           begin, end, out);
    return;
  }
  const Tensor& t = quantize_deferred(param).*field;
  RIG_CHECK(t.defined() && begin >= 0 && begin <= end && size_t(end) <= t.nbytes(),
            "bytes [{}, {}) of a {}-byte tensor of {}", begin, end, t.nbytes(),
            params_[param].name);
  std::memcpy(out, static_cast<const uint8_t*>(t.raw()) + begin, size_t(end - begin));
}

void LlamaModel::drop_4bit_cache() {
  cached_param_ = SIZE_MAX;
  cached_ = quant::QuantizedWeight();
}

void LlamaModel::set_4bit_offsets(const std::vector<float>& offsets) {
  RIG_CHECK(offsets.size() == params_.size(), "{} offsets for {} parameters", offsets.size(),
            params_.size());
  for (size_t i = 0; i < params_.size(); ++i)
    if (params_[i].quant) params_[i].quant->nested_offset = offsets[i];
  offsets_pending_ = false;
}

void LlamaModel::materialize_4bit(Device dev) {
  if (!codes_deferred_) return;
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!params_[i].quant) continue;
    quant::QuantizedWeight& q = *params_[i].quant;
    if (deferred_files_) {
      quantize_deferred(i);
      q = cached_.to(dev);
    } else {
      quant::draw_4bit(q, mix_seed(codes_seed_, int(i), -1));
      q = q.to(dev);
    }
  }
  codes_deferred_ = offsets_pending_ = false;
  deferred_files_.reset();
  drop_4bit_cache();
  qbuf_ = qview_ = Tensor();
}

void LlamaModel::add_lora(const LoraConfig& lora, uint64_t seed) {
  RIG_CHECK(!lora_, "LoRA is already attached");
  RIG_CHECK(act_ == DType::F32, "attach LoRA before set_compute_dtype");
  lora.validate("lora");
  lora_ = lora;
  for (auto& p : params_) p.trainable = false;
  std::mt19937_64 rng(seed);
  for (auto& L : layers_)
    for (int pi = 0; pi < 7; ++pi) {
      if (!lora.targets_module(kProjections[size_t(pi)])) continue;
      Linear& lin = L->proj[pi];
      const Shape& ws = params_[size_t(lin.w)].shape();
      const int64_t out = ws[0], in = ws[1];
      std::string pre = "base_model.model." + lin.module;
      Tensor a = fresh({lora.r, in}, "lora_A"), b = Tensor::zeros({out, lora.r}, DType::F32, Device::cpu(), "lora_B");
      // PEFT: kaiming_uniform_(a=sqrt(5)) gives bound 1/sqrt(fan_in).
      std::uniform_real_distribution<float> uni(-1.0f / std::sqrt(float(in)), 1.0f / std::sqrt(float(in)));
      for (int64_t i = 0; i < a.numel(); ++i) a.f32()[i] = uni(rng);
      lin.lora_a = int(params_.size());
      register_param(pre + ".lora_A.default.weight", a.to(dev_, "lora_A"), false, true);
      lin.lora_b = int(params_.size());
      register_param(pre + ".lora_B.default.weight", b.to(dev_, "lora_B"), false, true);
      lin.lora_scale = lora.scaling();
      lin.lora_dropout = lora.dropout;
    }
}

namespace {
// PEFT saves adapter weights without the adapter name: ".lora_A.weight".
std::string peft_file_key(const std::string& param) {
  std::string k = param;
  auto pos = k.find(".default.weight");
  if (pos != std::string::npos) k.replace(pos, 15, ".weight");
  return k;
}
}  // namespace

void LlamaModel::load_adapter(const std::string& dir) {
  LoraConfig lc = load_lora_config(dir);
  add_lora(lc, 0);
  std::string path = (fs::path(dir) / "adapter_model.safetensors").string();
  SafeTensorsFile f = SafeTensorsFile::open(path);
  for (auto& p : params_) {
    if (p.name.find(".lora_") == std::string::npos) continue;
    std::string key = peft_file_key(p.name);
    if (!f.has(key)) bad_input("{}: adapter has no tensor '{}'", path, key);
    if (f.info(key).shape != p.value.shape())
      bad_input("{}: tensor '{}' has shape {}, expected {}", path, key, shape_str(f.info(key).shape),
                shape_str(p.value.shape()));
    p.value.copy_from(f.get_f32(key));
  }
}

void LlamaModel::save_adapter(const std::string& dir) const {
  RIG_CHECK(lora_, "save_adapter: no LoRA attached");
  fs::create_directories(dir);
  std::vector<std::pair<std::string, Tensor>> ts;
  for (const auto& p : params_)
    if (p.name.find(".lora_") != std::string::npos) ts.emplace_back(peft_file_key(p.name), p.value);
  save_safetensors((fs::path(dir) / "adapter_model.safetensors").string(), ts, {{"format", "pt"}});
  nlohmann::json c = {{"peft_type", "LORA"},
                      {"task_type", "CAUSAL_LM"},
                      {"r", lora_->r},
                      {"lora_alpha", lora_->alpha},
                      {"lora_dropout", lora_->dropout},
                      {"use_rslora", lora_->rslora},
                      {"target_modules", lora_->targets},
                      {"bias", "none"},
                      {"fan_in_fan_out", false},
                      {"inference_mode", true},
                      {"init_lora_weights", true},
                      {"modules_to_save", nullptr},
                      {"base_model_name_or_path", nullptr},
                      {"use_dora", false}};
  write_file_atomic((fs::path(dir) / "adapter_config.json").string(), c.dump(2) + "\n");
}

void LlamaModel::merge_lora(std::optional<Device> compute) {
  RIG_CHECK(lora_, "merge_lora: no LoRA attached");
  RIG_CHECK(act_ == DType::F32, "merge_lora needs float32 weights");
  const Device on = compute.value_or(dev_);
  if (on == dev_) {
    dequantize_weights();  // a QLoRA base: B·A·scale goes onto the dequantized weights
    for (auto& L : layers_)
      for (auto& lin : L->proj) {
        if (lin.lora_a < 0) continue;
        Tensor& w = params_[size_t(lin.w)].value;
        ops::gemm(params_[size_t(lin.lora_b)].value, false, params_[size_t(lin.lora_a)].value,
                  false, w, lin.lora_scale, 1.0f);
        lin.lora_a = lin.lora_b = -1;
      }
  } else {
    // Each linear weight that changes travels once each way: a 4-bit one is decoded on `on`
    // (bit for bit the CPU's decoding), the product is added there, and the float32 result
    // comes back. Only one weight and its LoRA pair are on `on` at a time.
    for (auto& L : layers_)
      for (auto& lin : L->proj) {
        Param& p = params_[size_t(lin.w)];
        if (!p.quant && lin.lora_a < 0) continue;
        Tensor w;
        if (p.quant) {
          const quant::QuantizedWeight q = p.quant->to(on);
          w = Tensor::empty(q.shape, DType::F32, on, "dequantized weight");
          quant::dequantize_4bit(q, w);
        } else {
          w = p.value.to(on, p.name);
        }
        if (lin.lora_a >= 0) {
          const Tensor a = params_[size_t(lin.lora_a)].value.to(on, "lora_A"),
                       b = params_[size_t(lin.lora_b)].value.to(on, "lora_B");
          ops::gemm(b, false, a, false, w, lin.lora_scale, 1.0f);
          lin.lora_a = lin.lora_b = -1;
        }
        if (p.quant) {
          p.value = w.to(dev_, p.name);
          p.quant.reset();
          p.compute_operand = true;
        } else {
          p.value.copy_from(w);
        }
      }
    dequantize_weights();  // 4-bit weights outside the linear layers, if any (none today)
  }
  std::erase_if(params_, [](const Param& p) { return p.name.find(".lora_") != std::string::npos; });
  for (auto& p : params_) p.trainable = true;
  lora_.reset();
}

int64_t LlamaModel::num_parameters(bool trainable_only) const {
  int64_t n = 0;
  for (const auto& p : params_)
    if (!trainable_only || p.trainable) n += p.numel();
  return n;
}

void LlamaModel::quantize_weights(quant::QuantType type, int64_t blocksize, bool double_quant) {
  RIG_CHECK(act_ == DType::F32, "quantize_weights: call before set_compute_dtype");
  for (auto& L : layers_)
    for (auto& lin : L->proj) {
      Param& p = params_[size_t(lin.w)];
      if (p.quant) continue;
      Tensor host = p.value.device().is_cpu() ? p.value : p.value.to(Device::cpu(), p.name);
      auto q = quant::quantize_4bit(host, type, blocksize, double_quant);
      p.quant = std::make_shared<quant::QuantizedWeight>(q.to(dev_));
      p.value = p.compute = p.grad = Tensor();
      p.trainable = false;
      p.compute_operand = false;
    }
  quant::QuantConfig qc;
  qc.type = type;
  qc.blocksize = blocksize;
  qc.double_quant = double_quant;
  qcfg_ = qc;
}

void LlamaModel::dequantize_weights() {
  RIG_CHECK(act_ == DType::F32, "dequantize_weights needs the float32 compute dtype");
  for (auto& p : params_) {
    if (!p.quant) continue;
    p.value = Tensor::empty(p.quant->shape, DType::F32, dev_, "dequantized weight");
    quant::dequantize_4bit(*p.quant, p.value);
    p.quant.reset();
    p.compute_operand = true;
  }
  qbuf_ = qview_ = Tensor();
  qcfg_.reset();
}

bool LlamaModel::is_quantized() const {
  return std::any_of(params_.begin(), params_.end(), [](const Param& p) { return bool(p.quant); });
}

size_t LlamaModel::quantized_bytes() const {
  size_t n = 0;
  for (const auto& p : params_)
    if (p.quant) n += p.quant->nbytes();
  return n;
}

const Tensor& LlamaModel::weight_operand(int idx) {
  Param& p = params_[size_t(idx)];
  if (!p.quant) return p.operand();
  const int64_t n = p.quant->numel();
  if (!qbuf_.defined() || qbuf_.dtype() != act_ || qbuf_.device() != dev_ || qbuf_.numel() < n) {
    int64_t most = n;  // sized once for the largest 4-bit weight
    for (const auto& q : params_)
      if (q.quant) most = std::max(most, q.quant->numel());
    qview_ = qbuf_ = Tensor();
    qbuf_ = Tensor::empty({most}, act_, dev_, "dequantized weight");
  }
  qview_ = qbuf_.slice_rows(0, n).reshape(p.quant->shape);
  quant::dequantize_4bit(*p.quant, qview_);
  return qview_;
}

void LlamaModel::zero_grad() {
  for (auto& p : params_) {
    if (!p.trainable) {
      p.grad = Tensor();
      continue;
    }
    if (!p.grad.defined()) p.grad = Tensor::empty(p.value.shape(), DType::F32, p.value.device(), "gradient");
    p.grad.zero_();
  }
}

void LlamaModel::ensure_rope(int64_t positions) {
  if (rope_cos_.defined() && rope_cos_.dim(0) >= positions) return;
  int64_t n = std::max<int64_t>(positions, 256);
  std::vector<double> inv = rope_inv_freq(cfg_);
  const int64_t half = int64_t(inv.size());
  rope_cos_ = fresh({n, half}, "rope cos");
  rope_sin_ = fresh({n, half}, "rope sin");
  for (int64_t p = 0; p < n; ++p)
    for (int64_t i = 0; i < half; ++i) {
      // float32 angle, as transformers computes position * inv_freq.
      float ang = float(p) * float(inv[size_t(i)]);
      rope_cos_.f32()[p * half + i] = std::cos(ang);
      rope_sin_.f32()[p * half + i] = std::sin(ang);
    }
  rope_cos_ = rope_cos_.to(dev_, "rope cos");
  rope_sin_ = rope_sin_.to(dev_, "rope sin");
}

void LlamaModel::save_pretrained(const std::string& dir, DType dtype, size_t max_shard_bytes) const {
  fs::create_directories(dir);
  std::vector<std::vector<std::pair<std::string, Tensor>>> shards(1);
  size_t cur = 0;
  for (const auto& p : params_) {
    if (p.name.find(".lora_") != std::string::npos) continue;
    if (p.quant) {  // bitsandbytes' six tensors, as transformers saves a Linear4bit
      for (auto& kv : quant::state_dict(p.name, *p.quant)) {
        if (cur > 0 && cur + kv.second.nbytes() > max_shard_bytes) {
          shards.emplace_back();
          cur = 0;
        }
        cur += kv.second.nbytes();
        shards.back().push_back(std::move(kv));
      }
      continue;
    }
    Tensor host = p.value.device().is_cpu() ? p.value : p.value.to(Device::cpu(), p.name);
    Tensor t = host.dtype() == dtype ? host : host.to_dtype(DType::F32).to_dtype(dtype);
    if (cur > 0 && cur + t.nbytes() > max_shard_bytes) {
      shards.emplace_back();
      cur = 0;
    }
    shards.back().emplace_back(p.name, t);
    cur += t.nbytes();
  }
  nlohmann::json cfg = cfg_.to_json();
  cfg["torch_dtype"] = dtype == DType::BF16 ? "bfloat16" : dtype == DType::F16 ? "float16" : "float32";
  cfg["dtype"] = cfg["torch_dtype"];
  cfg.erase("quantization_config");
  const bool four_bit = is_quantized();
  if (four_bit)
    cfg["quantization_config"] =
        quant::quantization_config_json(qcfg_.value_or(quant::QuantConfig{}));
  if (shards.size() == 1) {
    save_safetensors((fs::path(dir) / "model.safetensors").string(), shards[0], {{"format", "pt"}},
                     four_bit);
  } else {
    nlohmann::json index = {{"metadata", {{"total_size", 0}}}, {"weight_map", nlohmann::json::object()}};
    size_t total = 0;
    for (size_t i = 0; i < shards.size(); ++i) {
      std::string fname = fmt::format("model-{:05d}-of-{:05d}.safetensors", i + 1, shards.size());
      save_safetensors((fs::path(dir) / fname).string(), shards[i], {{"format", "pt"}}, four_bit);
      for (auto& [n, t] : shards[i]) {
        index["weight_map"][n] = fname;
        total += t.nbytes();
      }
    }
    index["metadata"]["total_size"] = total;
    write_file_atomic((fs::path(dir) / "model.safetensors.index.json").string(), index.dump(2) + "\n");
  }
  write_file_atomic((fs::path(dir) / "config.json").string(), cfg.dump(2) + "\n");
}

std::vector<int> LlamaModel::param_groups() const {
  std::vector<int> g(params_.size(), -1);
  for (size_t l = 0; l < layers_.size(); ++l) {
    const Layer& L = *layers_[l];
    for (int i : {L.in_norm, L.post_norm, L.q_norm, L.k_norm})
      if (i >= 0) g[size_t(i)] = int(l);
    for (const Linear& lin : L.proj)
      for (int i : {lin.w, lin.b, lin.lora_a, lin.lora_b})
        if (i >= 0) g[size_t(i)] = int(l);
  }
  return g;
}

}  // namespace rig
