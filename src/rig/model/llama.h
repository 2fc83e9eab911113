// A LLaMA-family decoder (llama, qwen2, mistral) with explicit forward and backward per layer.
// Weights, gradients and activations are float32 by default. With a BF16 compute dtype (CUDA),
// matrix products read bf16 weights and activations and accumulate in float32, while the
// residual stream, norms, gradients and the trainable (master) weights stay float32.
// Parameters carry their Hugging Face names; LoRA parameters carry PEFT's
// (base_model.model.<module>.lora_A.default.weight).
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "rig/core/tensor.h"
#include "rig/model/config.h"
#include "rig/model/lora.h"
#include "rig/quant/nf4.h"

namespace rig {

class WeightFiles;

struct Param {
  std::string name;
  Tensor value, grad;  // grad is defined for trainable parameters after zero_grad()
  // Under a BF16 compute dtype, the BF16 copy of a trainable operand that the products read
  // (AdamW refreshes it with each step; refresh_compute_weights() after any other change to
  // `value`); undefined otherwise. Frozen matrices
  // under BF16 are stored in BF16 (`value` itself) and have no copy.
  Tensor compute;
  bool trainable = true;
  bool no_decay = false;  // norms and biases, for optimizers that exempt them
  // Read by the products in the compute dtype: linear, LoRA, embedding and LM head matrices, and
  // linear biases (cuBLASLt's bias epilogue wants the bias in the output's dtype).
  bool compute_operand = false;
  // A frozen linear weight kept 4-bit (bitsandbytes NF4/FP4): `value` is then undefined and the
  // products read the weight dequantized, one matrix at a time, just before they use it.
  std::shared_ptr<quant::QuantizedWeight> quant;
  // What the products read (not for quantized weights: LlamaModel dequantizes those).
  const Tensor& operand() const { return compute.defined() ? compute : value; }
  const Shape& shape() const { return quant ? quant->shape : value.shape(); }
  int64_t numel() const { return quant ? quant->numel() : value.numel(); }
};

// How LlamaModel::load treats 4-bit weights.
struct LoadOptions {
  // Quantize the decoder's linear weights while loading (one tensor at a time, as bitsandbytes'
  // quantize_4bit), unless the folder stores them quantized already. QLoRA's base.
  bool quantize = false;
  quant::QuantType quant_type = quant::QuantType::NF4;
  int64_t blocksize = 64;
  bool double_quant = true;
  // Decode a bitsandbytes folder's 4-bit weights into plain float32 parameters.
  bool dequantize = false;
  // LlamaModel::random with quantize: draw the 4-bit weights straight as codes
  // (quant/random_codes.h) instead of drawing floats and quantizing them, and leave their tensors
  // to be made on demand (deferred_4bit_bytes, materialize_4bit): a sharded rank makes only its own.
  bool draw_codes = false;
  // LlamaModel::load with quantize, for a sharded rank: a float weight stays in the folder until
  // its bytes are asked for (deferred_4bit_bytes), so a rank quantizes the weights its shards
  // cover, not the whole model, and never holds the whole 4-bit model on the host. A weight's
  // nested offset is known only where it was quantized (Sharded shares them).
  bool defer_quantize = false;
  // The caller freezes the base (LoRA, QLoRA) and computes in bf16 (set_compute_dtype before
  // use): matrices the products read that the folder stores in bf16 are kept as they are,
  // not widened to float32 on the host and narrowed again (half the host memory, no casts).
  bool frozen_bf16 = false;
};

// input_ids and labels [B, T] int64; labels -100 are ignored and shifted inside the loss.
// position_ids and segment_ids [B, T] int64 are optional (packing: positions restart per sample
// and attention stays inside a segment).
struct TokenBatch {
  Tensor input_ids, labels, position_ids, segment_ids;
};

// What each layer keeps from its forward for its backward. None: everything the backward reads.
// Selective: the outputs of the matrix products (and attention); the element-wise work (the two
// RMSNorm outputs, SwiGLU) is recomputed in backward. Full: the layer's input only; the whole
// forward runs again in backward. Activations no backward product reads are never kept.
enum class Checkpointing { None, Selective, Full };

// Called by step() around each group of parameters so a distributed strategy can gather sharded
// weights just before use and reduce gradients as soon as they are final. Group l >= 0 is layer
// l; group -1 the outer parameters (embedding, final norm, lm_head), in use for the whole step.
// See LlamaModel::param_groups().
struct StepHooks {
  enum Phase { Forward, Backward };
  virtual ~StepHooks() = default;
  // Before the group's weights are read; Backward: also before its gradients are written.
  virtual void before(int group, Phase phase) = 0;
  // After their last use; Backward: the group's gradients are final for this micro-batch.
  virtual void after(int group, Phase phase) = 0;
  // Within group -1: the input embedding (after its lookup) or the head (final norm and lm_head,
  // after the loss and the final norm's backward) is not read again in this step, so a strategy
  // may free its gathered copy for the layers. Gradients are still final only at after(-1).
  enum OuterPart { Embedding, Head };
  virtual void outer_done(OuterPart) {}
  // Within group -1: the head is about to be read (after the last layer's forward), so a
  // strategy that held its gathered copy back during the layers must provide it now.
  virtual void outer_needed(OuterPart) {}
  // A strategy that provides a frozen lm_head in slices of vocabulary rows (so the whole matrix
  // is never gathered at once): how many (0: the head is bound whole), and slice c ([rows, H] in
  // the compute dtype, its first row v0), gathered while `next` (-1: none) is prefetched, until
  // head_slice_done(c).
  virtual int head_slices() const { return 0; }
  virtual Tensor head_slice(int c, int next, int64_t& v0) {
    (void)c, (void)next, (void)v0;
    return {};
  }
  virtual void head_slice_done(int) {}
};

struct StepOptions {
  bool backward = true;
  Tensor* logits = nullptr;  // when set, receives the [B, T, V] logits (float32, CPU)
  // Gradient of the summed token loss is scaled by this; 0 means 1/valid tokens of this batch
  // (the mean, as transformers computes it). Gradient accumulation passes 1/total tokens.
  float grad_scale = 0;
  Checkpointing checkpointing = Checkpointing::None;
  // Full only: the first this many layers recompute their forward and the rest run selective, to
  // spend memory that full checkpointing leaves free on less recompute. Negative: every layer.
  int64_t recompute_layers = -1;
  uint64_t dropout_seed = 0;
  int64_t loss_chunk_rows = 0;  // rows of logits materialised at once; 0: loss_chunk_rows_for
  StepHooks* hooks = nullptr;
};

struct StepResult {
  double loss_sum = 0;
  int64_t tokens = 0;  // tokens with a label
  double loss() const { return tokens ? loss_sum / double(tokens) : 0.0; }
};

class LlamaModel {
 public:
  // From a Hugging Face model folder (config.json + safetensors); weights converted to float32.
  // A bitsandbytes 4-bit folder (quantization_config in config.json; transformers' layout of
  // weight + weight.absmax/quant_map/nested_*/quant_state) keeps its linear weights 4-bit.
  static std::unique_ptr<LlamaModel> load(const std::string& dir, const LoadOptions& opt = {});
  // Random initialisation (normal(0, 0.02) for matrices, ones for norms), seeded. With
  // opt.quantize the decoder's linear weights are drawn and quantized one at a time (the same
  // values quantize_weights() would quantize), so a 70B shape never needs its float32 copy.
  static std::unique_ptr<LlamaModel> random(const ModelConfig& cfg, uint64_t seed,
                                            const LoadOptions& opt = {});

  const ModelConfig& config() const { return cfg_; }
  // Moves every parameter (and later scratch) to `dev`. Weights stay float32 there.
  void to_device(Device dev);
  Device device() const { return dev_; }
  // F32 (default) or BF16 (CUDA only). Call after to_device and after LoRA is attached.
  void set_compute_dtype(DType dt);
  DType compute_dtype() const { return act_; }
  // Re-derives the BF16 copies of trainable matrices from their float32 values (after an
  // optimizer step or a checkpoint load); a no-op in float32.
  void refresh_compute_weights();

  // Adds LoRA to the targeted projections (A kaiming-uniform, B zero, as PEFT) and freezes
  // every base weight.
  void add_lora(const LoraConfig& lora, uint64_t seed);
  bool has_lora() const { return lora_.has_value(); }
  const LoraConfig& lora() const { return *lora_; }
  // A PEFT adapter folder: adds LoRA with its config and loads its weights.
  void load_adapter(const std::string& dir);
  void save_adapter(const std::string& dir) const;
  // Folds B·A·scale into the base weights and removes LoRA (4-bit weights are dequantized first).
  // With `compute` set to another device (a model on the CPU, a GPU to merge on), each 4-bit
  // weight is dequantized and each product runs there, one weight at a time, and the result comes
  // back; the model stays where it is (float32), so the device holds one weight at a time.
  void merge_lora(std::optional<Device> compute = std::nullopt);

  // Quantizes every decoder linear weight that is not yet (on the host, one at a time) and
  // freezes it.
  void quantize_weights(quant::QuantType type = quant::QuantType::NF4, int64_t blocksize = 64,
                        bool double_quant = true);
  // Turns 4-bit weights back into float32 parameters (as bitsandbytes dequantizes them).
  void dequantize_weights();
  bool is_quantized() const;
  // 4-bit tensors still to be made: drawn (LoadOptions::draw_codes) or quantized from the
  // folder (LoadOptions::defer_quantize).
  bool codes_deferred() const { return codes_deferred_; }
  // Deferred weights quantized from the folder whose nested offsets are not all known here yet
  // (each is set on the rank that quantized the weight; set_4bit_offsets gives the rest).
  bool offsets_pending() const { return offsets_pending_; }
  void set_4bit_offsets(const std::vector<float>& offsets);  // one per parameter, 4-bit ones read
  // Bytes [begin, end) of one stored tensor of deferred 4-bit parameter `param`: drawn, or taken
  // from the weight quantized on the first request (the latest one is kept for the next).
  void deferred_4bit_bytes(size_t param, Tensor quant::QuantizedWeight::*field, int64_t begin,
                           int64_t end, uint8_t* out);
  // How many weights deferred_4bit_bytes made from the folder (quantized, or read when stored
  // 4-bit); drop_4bit_cache frees the latest.
  int64_t deferred_quantized() const { return deferred_quantized_; }
  void drop_4bit_cache();
  // Makes every deferred 4-bit tensor on `dev`, one weight at a time.
  void materialize_4bit(Device dev);
  // Bytes the 4-bit weights take (packed nibbles, scales, maps).
  size_t quantized_bytes() const;

  std::vector<Param>& params() { return params_; }
  const std::vector<Param>& params() const { return params_; }
  Param* find_param(const std::string& name);
  int64_t num_parameters(bool trainable_only) const;
  // The StepHooks group of every parameter (index into params()): its layer, or -1.
  std::vector<int> param_groups() const;
  // Re-resolves the embedding, final norm and lm_head from params() after Param::value/compute
  // were replaced outside a step (so the old tensors are not kept alive).
  void bind_outer();
  void zero_grad();  // allocates gradients for trainable parameters on first use

  StepResult step(const TokenBatch& batch, const StepOptions& opt);

  // Logits of the last position for generation, with a key/value cache.
  struct KVCache {
    std::vector<Tensor> k, v;  // per layer [max_len, kv_dim], on the model's device, compute dtype
    int64_t len = 0;           // rows in use
    // Made once with the cache, on its device, so a decode step copies nothing to the device:
    // the positions 0..max_len-1 (int64), the last row's logits [1, V] (float32) and the greedy
    // pick [1] (int64) that the next decode_greedy step feeds back in.
    Tensor positions, logits, next;
  };
  // Make the cache after to_device and set_compute_dtype: it takes the model's device and dtype.
  KVCache new_cache(int64_t max_len) const;
  // Feeds tokens (appending to the cache) and returns the logits of the last one [V] (float32,
  // host). Several tokens (a prompt) run as one batch of rows through every layer.
  std::vector<float> decode(KVCache& cache, const std::vector<int64_t>& tokens);
  // Greedy decoding: feeds `tokens` (or, when empty, the id the previous decode_greedy call picked,
  // which is still on the device) and returns the argmax of the last row's logits over ids below
  // `limit` (0: the whole vocabulary). The pick runs where the model is and only the id comes
  // back: on a GPU one 8-byte copy (the step's only synchronisation) instead of the logits.
  int64_t decode_greedy(KVCache& cache, const std::vector<int64_t>& tokens, int64_t limit = 0);

  // Writes a Hugging Face model folder (config.json + model.safetensors, or shards past
  // max_shard_bytes with an index), atomically per file. 4-bit weights are written in
  // bitsandbytes' form with quantization_config in config.json.
  void save_pretrained(const std::string& dir, DType dtype = DType::F32,
                       size_t max_shard_bytes = size_t(4) << 30) const;

  struct Linear;
  struct Layer;
  struct Acts;

  ~LlamaModel();
  LlamaModel(const LlamaModel&) = delete;
  LlamaModel& operator=(const LlamaModel&) = delete;

 private:
  LlamaModel();
  // Registers every parameter; linear weights named by `four_bit` are registered 4-bit (no
  // float32 storage), waiting for their quantized data.
  void build(const ModelConfig& cfg, const std::function<bool(const std::string&)>& four_bit = {});
  void register_param(const std::string& name, Tensor t, bool no_decay, bool compute_operand);
  Tensor act(const Shape& s, const char* what) const;  // an activation in the compute dtype
  // One decode step on the device: ids [n] int64 on the model's device; leaves the last row's
  // logits in cache.logits.
  void decode_rows(KVCache& cache, const Tensor& ids);
  Tensor to_act(const Tensor& x) const;                 // x in the compute dtype (x if it is)
  void ensure_rope(int64_t positions);
  void layer_forward(int li, const Tensor& h_in, Acts& a, const TokenBatch& b, uint64_t seed);
  // dh (float32) is the residual gradient; dh_act its copy in the compute dtype (dh itself in
  // float32), read by the products and kept in step with dh.
  void layer_backward(int li, Acts& a, Tensor& dh, Tensor& dh_act, const TokenBatch& b,
                      uint64_t seed);
  // Whether projection `proj` of layer li reads its input in backward (a trainable weight or LoRA).
  bool reads_input(int li, int proj) const;
  // After a layer's forward: drops what `mode` does not keep. Before its backward (modes other
  // than Full): recomputes what was dropped and the backward reads.
  void drop_saved(int li, Acts& a, Checkpointing mode) const;
  void recompute_saved(int li, Acts& a);
  // The LM head and the loss (per-row losses into row_loss, on the device); with a backward,
  // returns the gradient of the final norm's output.
  Tensor head_and_loss(const Tensor& hn, const Tensor& targets, float scale, const StepOptions& opt,
                       Tensor& row_loss);
  // The same with the head read slice by slice from StepHooks::head_slice: the loss folds each
  // slice's logits into running statistics, and the backward gathers the slices again.
  Tensor head_and_loss_sliced(const Tensor& hn, const Tensor& targets, float scale,
                              const StepOptions& opt, Tensor& row_loss);
  // The backward of the final norm and of every layer (h: the last layer's output).
  void backward(std::vector<Acts>& acts, Tensor& dhn, const Tensor& h, const Tensor& rstd,
                const TokenBatch& dbatch, uint64_t seed, const StepOptions& opt);
  // The weight a product reads: the parameter's operand, or a 4-bit weight dequantized into the
  // one reused buffer (valid until the next call).
  const Tensor& weight_operand(int idx);

  ModelConfig cfg_;
  std::optional<LoraConfig> lora_;
  std::vector<Param> params_;
  std::vector<std::unique_ptr<Layer>> layers_;
  Tensor embed_, final_norm_, lm_head_;  // compute views (embed_ also feeds the embedding)
  Tensor rope_cos_, rope_sin_;
  Tensor cur_pos_;  // position ids of the batch in flight, flattened
  Device dev_;
  DType act_ = DType::F32;
  Tensor qbuf_, qview_;  // the dequantization buffer (largest 4-bit weight, compute dtype)
  std::optional<quant::QuantConfig> qcfg_;  // quantization_config of a 4-bit model
  bool codes_deferred_ = false;
  uint64_t codes_seed_ = 0;
  // LoadOptions::defer_quantize: the folder, the latest weight quantized from it.
  std::shared_ptr<const WeightFiles> deferred_files_;
  size_t cached_param_ = SIZE_MAX;
  quant::QuantizedWeight cached_;
  int64_t deferred_quantized_ = 0;
  bool offsets_pending_ = false;
  // The deferred 4-bit weight `param`, quantized from the folder (cached_).
  const quant::QuantizedWeight& quantize_deferred(size_t param);
};

// Closed-form inverse frequencies with the config's rope scaling (float64).
std::vector<double> rope_inv_freq(const ModelConfig& cfg);

}  // namespace rig
