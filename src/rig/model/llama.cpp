#include "rig/model/llama.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <random>

#include "rig/io/atomic_file.h"
#include "rig/io/safetensors.h"
#include "rig/ops/ops.h"

namespace rig {

namespace fs = std::filesystem;

struct LlamaModel::Linear {
  std::string module;  // Hugging Face module name, e.g. model.layers.0.self_attn.q_proj
  int w = -1, b = -1, lora_a = -1, lora_b = -1;  // indices into params_
  float lora_scale = 0, lora_dropout = 0;
};

struct LlamaModel::Layer {
  int in_norm = -1, post_norm = -1;
  Linear proj[7];  // q k v o gate up down
};

// What one layer's backward needs from its forward.
struct LlamaModel::Acts {
  Tensor h_in, xn1, rstd1, q, k, v, attn, lse, h_mid, xn2, rstd2, g, u, act, h_out;
  Tensor xa[7];  // LoRA: dropout(x) @ A^T per projection
  void drop_all_but_input() {
    Tensor keep = h_in;
    *this = Acts();
    h_in = keep;
  }
};

namespace {
enum { Q, K, V, O, GATE, UP, DOWN };

Tensor fresh_on(Device d, const Shape& s, const char* what) { return Tensor::empty(s, DType::F32, d, what); }
Tensor fresh(const Shape& s, const char* what) { return fresh_on(Device::cpu(), s, what); }
// Scratch on the device and in the dtype of `like`.
Tensor fresh_like(const Tensor& like, const Shape& s, const char* what) {
  return Tensor::empty(s, like.dtype(), like.device(), what);
}

uint64_t mix_seed(uint64_t seed, int layer, int proj) {
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + uint64_t(layer) * 0xBF58476D1CE4E5B9ull + uint64_t(proj + 1);
  x ^= x >> 31;
  return x * 0x94D049BB133111EBull;
}
}  // namespace

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

std::unique_ptr<LlamaModel> LlamaModel::load(const std::string& dir, const LoadOptions& opt) {
  ModelConfig cfg = ModelConfig::load(dir);
  const auto qcfg =
      quant::parse_quantization_config(cfg.raw, (fs::path(dir) / "config.json").string());
  WeightFiles w = WeightFiles::open_dir(dir);
  std::unique_ptr<LlamaModel> m(new LlamaModel());
  // Linear weights stay (or become) 4-bit unless asked for float32.
  m->build(cfg, [&](const std::string& name) {
    return !opt.dequantize && (opt.quantize || quant::is_quantized(w, name));
  });
  for (auto& p : m->params_) {
    if (!w.has(p.name)) bad_input("{}: weights have no tensor '{}' required by config.json", dir, p.name);
    const bool stored_4bit = quant::is_quantized(w, p.name);
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
    if (p.quant) {
      // Quantize while loading: one float tensor in memory at a time.
      Tensor src = w.get(p.name);
      if (src.dtype() == DType::F64) src = src.to_dtype(DType::F32);
      *p.quant = quant::quantize_4bit(src, opt.quant_type, opt.blocksize, opt.double_quant);
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
    // A weight to quantize is drawn into a temporary and replaced by its 4-bit form at once.
    Tensor drawn = quantize ? Tensor::empty(p.shape(), DType::F32, Device::cpu(), "weight") : p.value;
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
    if (quantize) *p.quant = quant::quantize_4bit(drawn, opt.quant_type, opt.blocksize, opt.double_quant);
  }
  if (opt.quantize) {
    quant::QuantConfig qc;
    qc.type = opt.quant_type;
    qc.blocksize = opt.blocksize;
    qc.double_quant = opt.double_quant;
    m->qcfg_ = qc;
  }
  return m;
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

void LlamaModel::merge_lora() {
  RIG_CHECK(lora_, "merge_lora: no LoRA attached");
  RIG_CHECK(act_ == DType::F32, "merge_lora needs float32 weights");
  dequantize_weights();  // a QLoRA base: B·A·scale goes onto the dequantized weights
  for (auto& L : layers_)
    for (auto& lin : L->proj) {
      if (lin.lora_a < 0) continue;
      Tensor& w = params_[size_t(lin.w)].value;
      ops::gemm(params_[size_t(lin.lora_b)].value, false, params_[size_t(lin.lora_a)].value, false, w,
                lin.lora_scale, 1.0f);
      lin.lora_a = lin.lora_b = -1;
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

namespace {

struct LinearRefs {
  const Tensor &w, &b, &a, &bl;
  Tensor *dw, *db, *da, *dbl;
};

// y = x @ W^T (+ bias) (+ LoRA); with `residual`, y = residual + that, the add riding the product.
void linear_forward(const LinearRefs& L, float scale, float p, uint64_t seed, const Tensor& x,
                    Tensor& y, Tensor* xa, const Tensor* residual = nullptr) {
  if (residual) {
    ops::gemm_plus(x, false, L.w, true, *residual, y, 1.0f, 1.0f);
    if (L.b.defined()) ops::add_bias(y, L.b);
  } else if (L.b.defined()) {
    ops::gemm_bias(x, false, L.w, true, y, L.b);
  } else {
    ops::gemm(x, false, L.w, true, y, 1.0f, 0.0f);
  }
  if (!L.a.defined()) return;
  Tensor xd = x;
  if (p > 0) {
    xd = fresh_like(x, x.shape(), "lora dropout");
    ops::dropout(x, p, seed, xd);
  }
  *xa = fresh_like(x, {x.dim(0), L.a.dim(0)}, "lora xa");
  ops::gemm(xd, false, L.a, true, *xa, 1.0f, 0.0f);
  ops::gemm(*xa, false, L.bl, true, y, scale, 1.0f);
}

// dx = dy @ W (+ dx when accumulate); parameter gradients accumulate where defined.
void linear_backward(const LinearRefs& L, float scale, float p, uint64_t seed, const Tensor& x,
                     const Tensor& dy, const Tensor& xa, Tensor& dx, bool accumulate) {
  if (L.dw) ops::gemm(dy, true, x, false, *L.dw, 1.0f, 1.0f);
  if (L.db) ops::bias_backward(dy, *L.db);
  ops::gemm(dy, false, L.w, false, dx, 1.0f, accumulate ? 1.0f : 0.0f);
  if (!L.a.defined()) return;
  if (L.dbl) ops::gemm(dy, true, xa, false, *L.dbl, scale, 1.0f);
  Tensor dxa = fresh_like(x, xa.shape(), "lora dxa");
  ops::gemm(dy, false, L.bl, false, dxa, scale, 0.0f);
  Tensor xd = x;
  if (p > 0) {
    xd = fresh_like(x, x.shape(), "lora dropout");
    ops::dropout(x, p, seed, xd);
  }
  if (L.da) ops::gemm(dxa, true, xd, false, *L.da, 1.0f, 1.0f);
  if (p > 0) {
    Tensor dxd = fresh_like(x, x.shape(), "lora dx");
    ops::gemm(dxa, false, L.a, false, dxd, 1.0f, 0.0f);
    ops::dropout(dxd, p, seed, xd);  // the same mask and 1/(1-p)
    ops::add_(dx, xd);
  } else {
    ops::gemm(dxa, false, L.a, false, dx, 1.0f, 1.0f);
  }
}

}  // namespace

#define RIG_LIN(lin)                                                                           \
  LinearRefs {                                                                                 \
    weight_operand((lin).w), (lin).b >= 0 ? params_[size_t((lin).b)].operand() : kNone,        \
        (lin).lora_a >= 0 ? params_[size_t((lin).lora_a)].operand() : kNone,                   \
        (lin).lora_b >= 0 ? params_[size_t((lin).lora_b)].operand() : kNone, grad_of((lin).w), \
        grad_of((lin).b), grad_of((lin).lora_a), grad_of((lin).lora_b)                         \
  }

namespace {
const Tensor kNone;
}

void LlamaModel::layer_forward(int li, const Tensor& h_in, Acts& a, const TokenBatch& b,
                               uint64_t seed) {
  auto grad_of = [&](int idx) -> Tensor* {
    return idx >= 0 && params_[size_t(idx)].grad.defined() ? &params_[size_t(idx)].grad : nullptr;
  };
  Layer& L = *layers_[size_t(li)];
  const int64_t N = h_in.dim(0), H = cfg_.hidden_size, F = cfg_.intermediate_size;
  const int64_t B = b.input_ids.dim(0), T = b.input_ids.dim(1), D = cfg_.head_dim;
  const float eps = float(cfg_.rms_norm_eps);
  auto lin = [&](int p, const Tensor& x, Tensor& y, const Tensor* residual = nullptr) {
    Linear& l = L.proj[p];
    linear_forward(RIG_LIN(l), l.lora_scale, seed ? l.lora_dropout : 0.0f, mix_seed(seed, li, p), x,
                   y, &a.xa[p], residual);
  };
  a.h_in = h_in;
  a.xn1 = act({N, H}, "xn1");
  a.rstd1 = fresh_on(dev_, {N}, "rstd");
  ops::rmsnorm_forward(h_in, params_[size_t(L.in_norm)].value, eps, a.xn1, a.rstd1);
  a.q = act({N, cfg_.q_dim()}, "q");
  a.k = act({N, cfg_.kv_dim()}, "k");
  a.v = act({N, cfg_.kv_dim()}, "v");
  lin(Q, a.xn1, a.q);
  lin(K, a.xn1, a.k);
  lin(V, a.xn1, a.v);
  ops::rope_forward(a.q, cur_pos_, rope_cos_, rope_sin_, int(cfg_.num_heads));
  ops::rope_forward(a.k, cur_pos_, rope_cos_, rope_sin_, int(cfg_.num_kv_heads));
  a.attn = act({N, cfg_.q_dim()}, "attention out");
  a.lse = fresh_on(dev_, {B, cfg_.num_heads, T}, "attention lse");
  Tensor o4 = a.attn.reshape({B, T, cfg_.num_heads, D});
  ops::attention_forward(a.q.reshape({B, T, cfg_.num_heads, D}),
                         a.k.reshape({B, T, cfg_.num_kv_heads, D}),
                         a.v.reshape({B, T, cfg_.num_kv_heads, D}), b.segment_ids, o4, a.lse);
  a.h_mid = fresh_like(h_in, {N, H}, "residual");
  lin(O, a.attn, a.h_mid, &h_in);
  a.xn2 = act({N, H}, "xn2");
  a.rstd2 = fresh_on(dev_, {N}, "rstd");
  ops::rmsnorm_forward(a.h_mid, params_[size_t(L.post_norm)].value, eps, a.xn2, a.rstd2);
  a.g = act({N, F}, "gate");
  a.u = act({N, F}, "up");
  lin(GATE, a.xn2, a.g);
  lin(UP, a.xn2, a.u);
  a.act = act({N, F}, "swiglu");
  ops::swiglu_forward(a.g, a.u, a.act);
  a.h_out = fresh_like(h_in, {N, H}, "residual");
  lin(DOWN, a.act, a.h_out, &a.h_mid);
}

bool LlamaModel::reads_input(int li, int proj) const {
  const Linear& l = layers_[size_t(li)]->proj[proj];
  return params_[size_t(l.w)].trainable || l.lora_a >= 0;  // dW, or LoRA's dA (and x·A)
}

void LlamaModel::drop_saved(int li, Acts& a, Checkpointing mode) const {
  if (mode == Checkpointing::Full) {
    a.drop_all_but_input();
    return;
  }
  // What no backward product reads goes in every mode; selective drops the rest of the
  // element-wise outputs too and recomputes them (recompute_saved).
  const bool sel = mode == Checkpointing::Selective;
  if (sel || !(reads_input(li, Q) || reads_input(li, K) || reads_input(li, V))) a.xn1 = Tensor();
  if (sel || !(reads_input(li, GATE) || reads_input(li, UP))) a.xn2 = Tensor();
  if (sel || !reads_input(li, DOWN)) a.act = Tensor();
}

void LlamaModel::recompute_saved(int li, Acts& a) {
  Layer& L = *layers_[size_t(li)];
  const int64_t N = a.h_in.dim(0), H = cfg_.hidden_size, F = cfg_.intermediate_size;
  const float eps = float(cfg_.rms_norm_eps);
  if (!a.xn1.defined() && (reads_input(li, Q) || reads_input(li, K) || reads_input(li, V))) {
    a.xn1 = act({N, H}, "xn1");
    ops::rmsnorm_forward(a.h_in, params_[size_t(L.in_norm)].value, eps, a.xn1, a.rstd1);
  }
  if (!a.xn2.defined() && (reads_input(li, GATE) || reads_input(li, UP))) {
    a.xn2 = act({N, H}, "xn2");
    ops::rmsnorm_forward(a.h_mid, params_[size_t(L.post_norm)].value, eps, a.xn2, a.rstd2);
  }
  if (!a.act.defined() && reads_input(li, DOWN)) {
    a.act = act({N, F}, "swiglu");
    ops::swiglu_forward(a.g, a.u, a.act);
  }
}

void LlamaModel::layer_backward(int li, Acts& a, Tensor& dh, Tensor& dh_act, const TokenBatch& b,
                                uint64_t seed) {
  auto grad_of = [&](int idx) -> Tensor* {
    return idx >= 0 && params_[size_t(idx)].grad.defined() ? &params_[size_t(idx)].grad : nullptr;
  };
  Layer& L = *layers_[size_t(li)];
  const int64_t N = dh.dim(0), H = cfg_.hidden_size, F = cfg_.intermediate_size;
  const int64_t B = b.input_ids.dim(0), T = b.input_ids.dim(1), D = cfg_.head_dim;
  auto lin_bwd = [&](int p, const Tensor& x, const Tensor& dy, Tensor& dx, bool acc) {
    Linear& l = L.proj[p];
    linear_backward(RIG_LIN(l), l.lora_scale, seed ? l.lora_dropout : 0.0f, mix_seed(seed, li, p),
                    x, dy, a.xa[p], dx, acc);
  };
  // dh += the norm's input gradient; dh_act, the products' operand, follows (when it is a copy).
  Tensor* dh_copy = dh_act.raw() == dh.raw() ? nullptr : &dh_act;
  auto norm_bwd = [&](const Tensor& dxn, const Tensor& x, int norm, const Tensor& rstd) {
    ops::rmsnorm_backward_add(dxn, x, params_[size_t(norm)].value, rstd, dh, dh_copy,
                              grad_of(norm));
  };
  // MLP. The residual gradient dh stays float32; the matrix products read dh_act.
  Tensor dact = act({N, F}, "d swiglu");
  lin_bwd(DOWN, a.act, dh_act, dact, false);
  Tensor dg = act({N, F}, "d gate"), du = act({N, F}, "d up");
  ops::swiglu_backward(dact, a.g, a.u, dg, du);
  dact = Tensor();
  Tensor dxn = fresh_on(dev_, {N, H}, "d xn2");
  lin_bwd(GATE, a.xn2, dg, dxn, false);
  lin_bwd(UP, a.xn2, du, dxn, true);
  dg = du = Tensor();
  norm_bwd(dxn, a.h_mid, L.post_norm, a.rstd2);
  // Attention
  Tensor dattn = act({N, cfg_.q_dim()}, "d attention");
  lin_bwd(O, a.attn, dh_act, dattn, false);
  Tensor dq = act({N, cfg_.q_dim()}, "dq"), dk = act({N, cfg_.kv_dim()}, "dk"), dv = act({N, cfg_.kv_dim()}, "dv");
  const int64_t Hq = cfg_.num_heads, Hk = cfg_.num_kv_heads;
  Tensor dq4 = dq.reshape({B, T, Hq, D}), dk4 = dk.reshape({B, T, Hk, D}), dv4 = dv.reshape({B, T, Hk, D});
  ops::attention_backward(dattn.reshape({B, T, Hq, D}), a.q.reshape({B, T, Hq, D}),
                          a.k.reshape({B, T, Hk, D}), a.v.reshape({B, T, Hk, D}), b.segment_ids,
                          a.attn.reshape({B, T, Hq, D}), a.lse, dq4, dk4, dv4);
  dattn = Tensor();
  ops::rope_backward(dq, cur_pos_, rope_cos_, rope_sin_, int(Hq));
  ops::rope_backward(dk, cur_pos_, rope_cos_, rope_sin_, int(Hk));
  lin_bwd(Q, a.xn1, dq, dxn, false);
  lin_bwd(K, a.xn1, dk, dxn, true);
  lin_bwd(V, a.xn1, dv, dxn, true);
  norm_bwd(dxn, a.h_in, L.in_norm, a.rstd1);
}

namespace {
// Segment ids as the attention kernels want them: each row's runs numbered 0, 1, 2, ... (the
// packer writes 1, 2, ... and 0 for trailing padding), so they never decrease along a row and
// the kernels can skip whole tiles before a segment's start; or no tensor at all when every row is
// one run, which is plain causal attention (the case cuDNN's fused kernel runs). Ids that come
// back after another run are kept as they are: renumbering would split their segment.
Tensor attention_segments(const Tensor& seg) {
  if (!seg.defined()) return seg;
  const int64_t B = seg.dim(0), T = seg.dim(1);
  const int64_t* s = seg.data<int64_t>();
  Tensor runs = Tensor::empty(seg.shape(), DType::I64, Device::cpu(), "segment runs");
  int64_t* r = runs.data<int64_t>();
  bool single = true;
  for (int64_t b = 0; b < B; ++b) {
    std::vector<int64_t> seen;
    int64_t run = 0;
    for (int64_t t = 0; t < T; ++t) {
      const int64_t i = b * T + t;
      if (t > 0 && s[i] != s[i - 1]) {
        if (std::find(seen.begin(), seen.end(), s[i]) != seen.end()) return seg;
        ++run;
      }
      if (t == 0 || s[i] != s[i - 1]) seen.push_back(s[i]);
      r[i] = run;
    }
    single = single && run == 0;
  }
  return single ? Tensor() : runs;
}
}  // namespace

StepResult LlamaModel::step(const TokenBatch& batch, const StepOptions& opt) {
  const Tensor& ids = batch.input_ids;
  if (act_ != DType::F32 && !dev_.is_cuda())
    bad_input("bf16 compute needs a CUDA device; the CPU backend computes in float32");
  RIG_CHECK(ids.ndim() == 2 && ids.dtype() == DType::I64, "input_ids must be int64 [B, T], got {} {}",
            dtype_name(ids.dtype()), shape_str(ids.shape()));
  RIG_CHECK(batch.labels.shape() == ids.shape() && batch.labels.dtype() == DType::I64,
            "labels must be int64 {}", shape_str(ids.shape()));
  const int64_t B = ids.dim(0), T = ids.dim(1), N = B * T, H = cfg_.hidden_size, Vv = cfg_.vocab_size;
  if (cfg_.sliding_window && T > *cfg_.sliding_window)
    bad_input("sequence length {} exceeds the model's sliding window {}, which rig does not support yet",
              T, *cfg_.sliding_window);
  // Positions: given, or 0..T-1 per row.
  cur_pos_ = Tensor::empty({N}, DType::I64, Device::cpu(), "positions");
  int64_t max_pos = 0;
  for (int64_t r = 0; r < N; ++r) {
    int64_t p = batch.position_ids.defined() ? batch.position_ids.data<int64_t>()[r] : r % T;
    cur_pos_.data<int64_t>()[r] = p;
    max_pos = std::max(max_pos, p);
  }
  ensure_rope(max_pos + 1);
  cur_pos_ = cur_pos_.to(dev_, "positions");
  // The batch arrives on the host; the layers need ids and segments where they run.
  const TokenBatch& host = batch;
  TokenBatch dbatch{ids.to(dev_, "input ids"), host.labels, {},
                    attention_segments(host.segment_ids)};
  if (dbatch.segment_ids.defined()) dbatch.segment_ids = dbatch.segment_ids.to(dev_, "segments");
  const uint64_t seed = opt.backward ? opt.dropout_seed : 0;
  // Full checkpointing recomputes the first recompute_layers layers (all when negative); the
  // others run selective.
  auto mode_of = [&](size_t l) {
    if (opt.checkpointing != Checkpointing::Full) return opt.checkpointing;
    return opt.recompute_layers < 0 || int64_t(l) < opt.recompute_layers ? Checkpointing::Full
                                                                          : Checkpointing::Selective;
  };

  StepHooks* hk = opt.hooks;
  const auto phase = opt.backward ? StepHooks::Backward : StepHooks::Forward;
  if (hk) {
    hk->before(-1, phase);
    bind_outer();
  }
  Tensor h = fresh_on(dev_, {N, H}, "embeddings");
  ops::embedding_forward(dbatch.input_ids.reshape({N}), embed_, h);
  std::vector<Acts> acts(layers_.size());
  for (size_t l = 0; l < layers_.size(); ++l) {
    if (hk) hk->before(int(l), StepHooks::Forward);
    layer_forward(int(l), h, acts[l], dbatch, seed);
    if (hk) hk->after(int(l), StepHooks::Forward);
    h = acts[l].h_out;
    if (opt.backward) {
      drop_saved(int(l), acts[l], mode_of(l));
    } else {
      acts[l] = Acts{};
    }
  }
  Tensor hn = act({N, H}, "final norm"), rstd = fresh_on(dev_, {N}, "rstd");
  ops::rmsnorm_forward(h, final_norm_, float(cfg_.rms_norm_eps), hn, rstd);

  // Targets: labels shifted left by one; the last position of each row has none.
  Tensor targets = Tensor::empty({N}, DType::I64, Device::cpu(), "targets");
  int64_t valid = 0;
  for (int64_t r = 0; r < N; ++r) {
    int64_t t = r % T;
    int64_t lab = t + 1 < T ? batch.labels.data<int64_t>()[r + 1] : -100;
    targets.data<int64_t>()[r] = lab;
    valid += lab != -100;
  }
  targets = targets.to(dev_, "targets");
  const float scale = opt.grad_scale > 0 ? opt.grad_scale : (valid ? 1.0f / float(valid) : 0.0f);
  if (opt.logits) *opt.logits = Tensor::empty({B, T, Vv}, DType::F32, Device::cpu(), "logits");

  StepResult res;
  Param* head = cfg_.tie_word_embeddings ? &params_.front() : find_param("lm_head.weight");
  Tensor dhn = opt.backward ? Tensor::zeros({N, H}, DType::F32, dev_, "d final norm") : Tensor();
  const int64_t chunk = std::max<int64_t>(1, opt.loss_chunk_rows);
  for (int64_t r0 = 0; r0 < N; r0 += chunk) {
    const int64_t r1 = std::min(N, r0 + chunk);
    Tensor x = hn.slice_rows(r0, r1);
    Tensor logits = fresh_on(dev_, {r1 - r0, Vv}, "logits chunk");
    ops::gemm(x, false, lm_head_, true, logits, 1.0f, 0.0f);
    if (opt.logits) opt.logits->reshape({N, Vv}).slice_rows(r0, r1).copy_from(logits);
    Tensor tg = targets.slice_rows(r0, r1);
    // float32 logits; their gradient in the products' dtype, written by the loss itself.
    Tensor dl = !opt.backward ? Tensor() : act_ == DType::F32 ? logits : act(logits.shape(), "d logits");
    res.loss_sum += ops::cross_entropy(logits, tg, scale, opt.backward ? &dl : nullptr, &res.tokens);
    if (!opt.backward) continue;
    Tensor dx = dhn.slice_rows(r0, r1);
    ops::gemm(dl, false, lm_head_, false, dx, 1.0f, 0.0f);
    if (head->grad.defined()) ops::gemm(dl, true, x, false, head->grad, 1.0f, 1.0f);
  }
  if (!opt.backward) {
    if (hk) {
      hk->after(-1, phase);
      bind_outer();
    }
    return res;
  }

  Tensor dh = fresh_on(dev_, {N, H}, "d hidden");
  Param* fn = find_param("model.norm.weight");
  Tensor dfn = fn->grad.defined() ? fn->grad : Tensor::zeros(fn->value.shape(), DType::F32, dev_, "frozen");
  ops::rmsnorm_backward(dhn, h, final_norm_, rstd, dh, dfn);
  dhn = hn = Tensor();
  Tensor dh_act = act_ == DType::F32 ? dh : act({N, H}, "d hidden operand");
  if (dh_act.raw() != dh.raw()) ops::cast(dh, dh_act);
  for (int l = int(layers_.size()) - 1; l >= 0; --l) {
    if (hk) hk->before(l, StepHooks::Backward);
    if (mode_of(size_t(l)) == Checkpointing::Full) {
      layer_forward(l, acts[size_t(l)].h_in, acts[size_t(l)], dbatch, seed);
    } else {
      recompute_saved(l, acts[size_t(l)]);
    }
    layer_backward(l, acts[size_t(l)], dh, dh_act, dbatch, seed);
    acts[size_t(l)] = Acts{};
    if (hk) hk->after(l, StepHooks::Backward);
  }
  if (params_.front().grad.defined())
    ops::embedding_backward(dbatch.input_ids.reshape({N}), dh, params_.front().grad);
  if (hk) {
    hk->after(-1, phase);
    bind_outer();
  }
  return res;
}

LlamaModel::KVCache LlamaModel::new_cache(int64_t max_len) const {
  KVCache c;
  for (size_t l = 0; l < layers_.size(); ++l) {
    c.k.push_back(Tensor::zeros({max_len, cfg_.kv_dim()}, DType::F32, Device::cpu(), "kv cache"));
    c.v.push_back(Tensor::zeros({max_len, cfg_.kv_dim()}, DType::F32, Device::cpu(), "kv cache"));
  }
  return c;
}

std::vector<float> LlamaModel::decode(KVCache& cache, const std::vector<int64_t>& tokens) {
  auto grad_of = [](int) -> Tensor* { return nullptr; };
  const int64_t H = cfg_.hidden_size, F = cfg_.intermediate_size, D = cfg_.head_dim;
  const int64_t Hq = cfg_.num_heads, Hk = cfg_.num_kv_heads, group = Hq / Hk;
  const float eps = float(cfg_.rms_norm_eps);
  std::vector<float> logits(size_t(cfg_.vocab_size));
  bind_outer();
  for (int64_t tok : tokens) {
    const int64_t pos = cache.len;
    RIG_CHECK(pos < cache.k[0].dim(0), "KV cache full at {} tokens", pos);
    ensure_rope(pos + 1);
    Tensor posv = Tensor::empty({1}, DType::I64);
    posv.data<int64_t>()[0] = pos;
    Tensor idv = Tensor::empty({1}, DType::I64);
    idv.data<int64_t>()[0] = tok;
    Tensor h = fresh_on(dev_, {1, H}, "decode"), xn = act({1, H}, "decode"), rs = fresh_on(dev_, {1}, "decode");
    posv = posv.to(dev_, "position");
    idv = idv.to(dev_, "token");
    ops::embedding_forward(idv, embed_, h);
    for (size_t l = 0; l < layers_.size(); ++l) {
      Layer& L = *layers_[l];
      Tensor xa;
      auto lin = [&](int p, const Tensor& x, Tensor& y) {
        linear_forward(RIG_LIN(L.proj[p]), L.proj[p].lora_scale, 0.0f, 0, x, y, &xa);
      };
      ops::rmsnorm_forward(h, params_[size_t(L.in_norm)].value, eps, xn, rs);
      // Projections run where the model is; the cache and this single-row attention on the host.
      Tensor qd = fresh_on(dev_, {1, cfg_.q_dim()}, "q"), kd = fresh_on(dev_, {1, cfg_.kv_dim()}, "k"),
             vd = fresh_on(dev_, {1, cfg_.kv_dim()}, "v");
      lin(Q, xn, qd);
      lin(K, xn, kd);
      lin(V, xn, vd);
      ops::rope_forward(qd, posv, rope_cos_, rope_sin_, int(Hq));
      ops::rope_forward(kd, posv, rope_cos_, rope_sin_, int(Hk));
      cache.k[l].slice_rows(pos, pos + 1).copy_from(kd);
      cache.v[l].slice_rows(pos, pos + 1).copy_from(vd);
      Tensor q = qd.to(Device::cpu(), "q");
      Tensor att = Tensor::zeros({1, cfg_.q_dim()}, DType::F32, Device::cpu(), "attention");
      const float sc = 1.0f / std::sqrt(float(D));
      std::vector<float> s(size_t(pos + 1));
      for (int64_t hh = 0; hh < Hq; ++hh) {
        const float* qh = q.f32() + hh * D;
        const int64_t kh = hh / group;
        float mx = -1e30f;
        for (int64_t j = 0; j <= pos; ++j) {
          const float* kj = cache.k[l].f32() + j * cfg_.kv_dim() + kh * D;
          float dot = 0;
          for (int64_t x = 0; x < D; ++x) dot += qh[x] * kj[x];
          s[size_t(j)] = dot * sc;
          mx = std::max(mx, s[size_t(j)]);
        }
        double sum = 0;
        for (int64_t j = 0; j <= pos; ++j) sum += std::exp(double(s[size_t(j)] - mx));
        float* oh = att.f32() + hh * D;
        for (int64_t j = 0; j <= pos; ++j) {
          float p = float(std::exp(double(s[size_t(j)] - mx)) / sum);
          const float* vj = cache.v[l].f32() + j * cfg_.kv_dim() + kh * D;
          for (int64_t x = 0; x < D; ++x) oh[x] += p * vj[x];
        }
      }
      Tensor o = fresh_on(dev_, {1, H}, "o");
      lin(O, to_act(att.to(dev_, "attention")), o);
      ops::add_(h, o);
      ops::rmsnorm_forward(h, params_[size_t(L.post_norm)].value, eps, xn, rs);
      Tensor g = fresh_on(dev_, {1, F}, "g"), u = fresh_on(dev_, {1, F}, "u"), sw = fresh_on(dev_, {1, F}, "swiglu");
      lin(GATE, xn, g);
      lin(UP, xn, u);
      ops::swiglu_forward(g, u, sw);
      lin(DOWN, to_act(sw), o);
      ops::add_(h, o);
    }
    ++cache.len;
    ops::rmsnorm_forward(h, final_norm_, eps, xn, rs);
    Tensor lg = fresh_on(dev_, {1, cfg_.vocab_size}, "logits");
    ops::gemm(xn, false, lm_head_, true, lg, 1.0f, 0.0f);
    Tensor::view(logits.data(), {1, cfg_.vocab_size}, DType::F32, Device::cpu(), nullptr).copy_from(lg);
  }
  return logits;
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
    for (int i : {L.in_norm, L.post_norm}) g[size_t(i)] = int(l);
    for (const Linear& lin : L.proj)
      for (int i : {lin.w, lin.b, lin.lora_a, lin.lora_b})
        if (i >= 0) g[size_t(i)] = int(l);
  }
  return g;
}

}  // namespace rig
