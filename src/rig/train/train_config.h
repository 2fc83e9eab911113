// A training run's configuration: a YAML file plus `--set key=value` overrides, resolved into one
// validated struct. Keys follow axolotl/torchtune names; axolotl's flat spellings (base_model,
// lora_r, learning_rate, ...) are accepted as aliases. Every key, with its aliases, default and
// documentation, is in the schema of train_config_schema.h, which docs/config-reference.md is
// rendered from.
#pragma once
#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

namespace rig {

struct LoraSettings {
  int64_t r = 16;
  double alpha = 32.0;
  double dropout = 0.0;
  std::vector<std::string> targets = {"q_proj", "k_proj", "v_proj", "o_proj"};
  bool rslora = false;  // scale alpha/sqrt(r) instead of alpha/r
  // alpha / r, or alpha / sqrt(r) with rslora.
  double scale() const;
};

struct DatasetSettings {
  std::string path;
  std::string format = "alpaca";     // alpaca | chat | text | tokens
  std::string template_name;  // auto | alpaca | llama3 | chatml; empty for text and tokens
};

struct OptimizerSettings {
  std::string name = "adamw";  // adamw | adamw8bit
  double lr = 2e-4;
  double beta1 = 0.9, beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  bool no_decay_on_norms_and_biases = true;
  int64_t min_8bit_size = 4096;  // adamw8bit: smaller tensors keep float32 moments
};

struct ScheduleSettings {
  std::string name = "cosine";  // constant | linear | cosine
  int64_t warmup_steps = 0;
  double min_lr_ratio = 0.0;  // the lr at the end as a fraction of the peak
  // The learning rate at optimizer step `step` (0-based) of `total` steps.
  double lr_at(int64_t step, int64_t total, double peak_lr) const;
};

struct EvalSettings {
  int64_t every = 0;    // optimizer steps between evaluations; 0: only at the end (if split > 0)
  double split = 0.0;   // fraction of the data held out for evaluation; 0: no evaluation
  int64_t batches = 0;  // micro-batches per evaluation; 0: the whole held-out set
  int64_t generate = 0;  // held-out samples generated greedily at the end for exact-match accuracy
};

struct ThermalSettings {
  double pause_above_c = 0;    // pause training while the hottest GPU is above this; 0: never
  double resume_below_c = 0;   // resume once every GPU is below this (0: 8 degrees under the pause)
};

struct SaveSettings {
  int64_t every = 0;      // optimizer steps between checkpoints; 0: only at the end
  int64_t keep_last = 3;  // complete checkpoints kept; 0: keep all
};

struct DistSettings {
  // How long a rank waits for the others in one collective (and at rendezvous) before it fails
  // naming the rank that is missing.
  double timeout_s = 600;
  double bucket_mb = 25;  // data-parallel gradient buckets
  int64_t powersgd_rank = 0;  // data-parallel gradient compression; 0: off
};

// The training guard (docs/reliability.md): what is checked during a run and what it does about
// it. Every check is on by default.
struct GuardSettings {
  // Skip an optimizer step whose loss or gradients hold NaN/Inf (weights, optimizer state and
  // the schedule untouched, the batch consumed); stop after this many in a row.
  bool skip_nonfinite = true;
  int64_t max_skips_in_row = 5;
  // Roll back to the last verified checkpoint when the loss or the gradient norm spikes: above
  // the median of the last spike_window steps by spike_k robust deviations (1.4826 x MAD), and
  // above spike_loss_ratio (loss) or spike_grad_ratio (gradient norm) times that median, once
  // spike_warmup steps are in the window.
  bool rollback_on_spike = true;
  int64_t spike_window = 100;
  int64_t spike_warmup = 20;
  double spike_k = 8;
  double spike_loss_ratio = 1.5;
  double spike_grad_ratio = 100;
  int64_t max_rollbacks = 3;  // per run; one more stops it for a human to look
  // Compare the parameters of data-parallel replicas (sharded: each rank's shards against
  // themselves) every this many steps and before every checkpoint; 0 turns it off.
  int64_t replica_check_every = 100;
  // Check a checkpoint (manifest, checksums, NaN/Inf) before resuming or rolling back to it.
  bool verify_checkpoints = true;
};

struct TrainConfig {
  // Where the weights come from: a pretrained model folder, or random init of an architecture.
  std::string model;               // HF model folder (config.json + safetensors)
  std::string init = "pretrained";  // pretrained | random
  // With init: random, the shape: a built-in name (architecture_name) or an inline HF-style config
  // (architecture). Both empty: take config.json from `model`.
  std::string architecture_name;
  nlohmann::json architecture;  // null or an object

  std::string method = "full";  // full | lora | qlora
  LoraSettings lora;
  std::vector<DatasetSettings> datasets;
  std::string tokenizer;  // tokenizer.json or a folder; empty: the model folder
  int64_t sequence_len = 2048;
  bool packing = true;
  bool train_on_inputs = false;

  int64_t micro_batch_size = 1;
  int64_t gradient_accumulation_steps = 1;
  int64_t max_steps = 0;    // 0: run num_epochs
  double num_epochs = 1.0;  // used when max_steps is 0

  OptimizerSettings optimizer;
  ScheduleSettings schedule;
  double max_grad_norm = 1.0;  // 0: no clipping

  std::string precision = "auto";                 // auto | fp32 | bf16 (auto: bf16 on CUDA)
  std::string activation_checkpointing = "none";  // none | full | selective
  // full only: layers (from the first) that recompute their forward; the rest run selective.
  // -1: every layer.
  int64_t recompute_layers = -1;
  std::string strategy = "auto";                  // auto | ddp | sharded (fsdp) (auto: ddp)
  DistSettings dist;
  EvalSettings eval;
  SaveSettings save;
  ThermalSettings thermal;
  GuardSettings guard;
  // Faults to inject, "KIND@STEP[:RANK]" (rig train --inject; docs/reliability.md). Recorded in
  // the resolved config, left out of the config hash, and not replayed by rig train --resume.
  std::vector<std::string> inject;
  uint64_t seed = 42;
  bool deterministic = false;  // bitwise-repeatable GPU kernels where faster ones are not
  std::string device = "auto";  // auto | cpu | cuda | cuda:N
  uint64_t max_memory = 0;      // bytes per device; 0: no budget
  std::string output_dir = "runs/run";
  std::string resume = "auto";  // auto | never | a checkpoint folder

  std::string source;  // the file it was read from (for messages; not part of the hash)

  // The precision actually used on `device_is_cuda` hardware ("fp32" or "bf16").
  std::string resolved_precision(bool device_is_cuda) const;
  // The architecture as an HF-style config object (built-in or inline), or null when it comes
  // from the model folder's config.json.
  nlohmann::json architecture_json() const;

  nlohmann::json to_json() const;  // every key, canonical names, resolved values
  nlohmann::ordered_json to_ordered_json() const;  // the same in documentation order
  std::string to_yaml() const;     // the same, as YAML that load_train_config reads back
  // XXH3 of the canonical JSON (sorted keys, no `source`): equal configs hash equal across runs.
  std::string config_hash() const;
  // Range and consistency checks; throws InputError naming the key.
  void validate() const;
};

// Reads `path` (YAML), applies overrides ("lora.r=8", "learning_rate=1e-4"; values parsed as YAML),
// resolves aliases and validates. Errors name the file, the line and the key, and suggest the
// closest valid key for a misspelled one.
TrainConfig load_train_config(const std::string& path, const std::vector<std::string>& overrides = {});
// The same from YAML text; `source` names it in messages.
TrainConfig parse_train_config(const std::string& yaml_text, const std::string& source,
                               const std::vector<std::string>& overrides = {});

// Writes the resolved config into a run folder: RUN_DIR/config.yaml and RUN_DIR/config.json
// (atomically; `rig report` shows the YAML).
void save_run_config(const TrainConfig& c, const std::string& run_dir);

// Built-in architecture shapes for init: random (tiny, llama3-8b, llama3-70b, ...), as HF
// config.json objects: the names and configs of the model catalogue (rig/model/catalog.h).
std::vector<std::string> builtin_architecture_names();
std::optional<nlohmann::json> builtin_architecture(const std::string& name);

// Levenshtein distance, and the candidate closest to `word` (empty if none is close enough).
size_t edit_distance(const std::string& a, const std::string& b);
std::string closest_match(const std::string& word, const std::vector<std::string>& candidates);

}  // namespace rig
